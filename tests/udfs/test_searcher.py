"""The executor's CPU searcher runs the backend the caller asked for."""
from __future__ import annotations

import numpy as np
import pytest

from nearest_kernels import knn
from udfs import searcher as S


@pytest.mark.parametrize("asked, runs", [("cpu", "cpu"), ("reference", "reference"), ("auto", "auto")])
def test_block_searcher_runs_the_backend_asked_for(monkeypatch, asked, runs):
    """backend="cpu" used to become "auto" here, and "auto" prefers a visible GPU."""
    seen = []

    def spy(q, t, k, metric, backend, **options):
        seen.append(backend)
        return knn(q, t, k, metric, backend="reference")

    monkeypatch.setattr(S, "knn", spy)
    q = np.array([[0.0, 0.0]], np.float32)
    t = np.array([[3.0, 4.0], [1.0, 0.0]], np.float32)
    values, indices = S.BlockSearcher(S.SearchSettings(2, "l2", asked), threads=1).search(q, t)
    assert seen == [runs]
    assert indices.tolist() == [[1, 0]] and values.tolist() == [[1.0, 5.0]]


def test_an_explicit_cpu_backend_never_opens_a_gpu_searcher(monkeypatch):
    monkeypatch.setattr(S, "cuda_may_exist", lambda: True)
    chosen = S.open_block_searcher(S.SearchSettings(2, "l2", "cpu"))
    assert type(chosen) is S.BlockSearcher and chosen.backend == "cpu"


def test_auto_opens_the_gpu_searcher_the_dispatcher_chooses(monkeypatch):
    import udfs.gpu as G
    from nearest_kernels import dispatch

    monkeypatch.setattr(S, "cuda_may_exist", lambda: True)
    monkeypatch.setattr(dispatch, "choose_task_backend", lambda backend, skip=None: ("gpu", []))
    sentinel = object()
    monkeypatch.setattr(G, "gpu_searcher_or_none", lambda settings: sentinel)
    assert S.open_block_searcher(S.SearchSettings(2, "l2", "auto")) is sentinel


def test_auto_without_a_gpu_probe_skips_the_gpu_backend_with_a_reason(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(S, "cuda_may_exist", lambda: False)
    with caplog.at_level(logging.INFO, logger="udfs.searcher"):
        chosen = S.open_block_searcher(S.SearchSettings(2, "l2", "auto"))
    assert type(chosen) is S.BlockSearcher and chosen.backend == "cpu"
    assert "task backend cpu (gpu: no GPU assigned" in caplog.text


def test_an_explicit_gpu_backend_without_a_device_is_an_error(monkeypatch):
    import udfs.gpu as G

    monkeypatch.setattr(G, "gpu_searcher_or_none", lambda settings: None)
    with pytest.raises(RuntimeError, match="backend 'gpu' requested"):
        S.open_block_searcher(S.SearchSettings(2, "l2", "gpu"))


def test_a_cpu_task_searches_its_blocks_without_importing_torch(monkeypatch):
    """Where the probe finds no GPU, the task's CPU searcher runs "cpu" on every block: "auto"
    per block would load the GPU backend first (the registry imports its module, and with it
    torch: seconds per Python worker) only to hear that it has no device."""
    from nearest_kernels import dispatch

    loaded = []
    load = dispatch._load

    def spy(entry):
        loaded.append(entry.name)
        return load(entry)

    monkeypatch.setattr(dispatch, "_load", spy)
    monkeypatch.setattr(S, "cuda_may_exist", lambda: False)
    chosen = S.open_block_searcher(S.SearchSettings(2, "l2", "auto"))
    values, indices = chosen.search(np.array([[0.0, 0.0]], np.float32), np.array([[3.0, 4.0], [1.0, 0.0]], np.float32))
    assert chosen.backend == "cpu" and indices.tolist() == [[1, 0]]
    assert "gpu" not in loaded and "cpu" in loaded


def test_auto_whose_gpu_searcher_cannot_open_runs_the_next_backend(monkeypatch):
    import udfs.gpu as G
    from nearest_kernels import dispatch

    monkeypatch.setattr(S, "cuda_may_exist", lambda: True)
    real = dispatch.choose_task_backend
    monkeypatch.setattr(dispatch, "choose_task_backend",
                        lambda backend, skip=None: ("gpu", []) if not skip else real(backend, skip=skip))
    monkeypatch.setattr(G, "gpu_searcher_or_none", lambda settings: None)
    chosen = S.open_block_searcher(S.SearchSettings(2, "l2", "auto"))
    assert type(chosen) is S.BlockSearcher and chosen.backend == "cpu"
