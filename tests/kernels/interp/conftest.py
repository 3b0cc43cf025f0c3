"""Collect this folder only under the Triton interpreter.

``TRITON_INTERPRET`` is read when triton loads, so it cannot be switched on for some tests of
a process: the main run leaves these modules out and runs them all in one subprocess with the
variable set (tests/kernels/test_gpu.py::test_kernels_under_the_triton_interpreter).
"""
from __future__ import annotations

import importlib.util
import os

# (Without triton or torch the parent test skips with that reason and never starts the run.)
if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None \
        or importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]
