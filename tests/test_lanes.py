"""The test files and folders that run as a pytest subprocess of their own beside the main run
(tests/background.py, LANES): each lane's test passes when every test of its paths that the
run selected passed or skipped there, and fails with their output otherwise.

``pytest tests/jobs`` or ``pytest tests/join`` (without this module) runs them in the main run
as usual.
"""
from __future__ import annotations

import pytest

from tests import background


@pytest.mark.background("join-oracles")
def test_join_oracle_tests_pass_in_their_lane():
    suite = background.lane_result("join-oracles")
    assert suite.junit()["tests"] > 0


@pytest.mark.background("approx-and-jobs")
def test_approx_plan_and_job_tests_pass_in_their_lane():
    suite = background.lane_result("approx-and-jobs")
    assert suite.junit()["tests"] > 0
