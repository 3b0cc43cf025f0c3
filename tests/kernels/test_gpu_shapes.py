"""The gpu backend at every real shape (issue 20's device matrix): d in {1, 3, 17, 64, 96, 100,
128, 200, 256, 300, 384, 512, 768, 1024, 1536, 2048, 3072, 4096} x k in {1, 10, 100, 1000} x
every precision x query rows in {1, 7, 2048, 65,536}, against the float64 oracle; no exception
for any of them.

Precisions: fp32, tf32 and bf16. ``"auto"`` is not a fourth: it resolves to bf16 on every
device this runs on (compute capability >= 8.0; :func:`nearest_kernels.gpu.resolve_precision`,
whose choice has its own CPU test), so it would repeat the bf16 case.

Data: non-centred Gaussian rows (a per-dimension offset, as in real embeddings), queries and
targets from the same distribution, drawn on the device; ``N_TARGETS`` targets (odd: a partial
last tile; more than the largest k). The metric rotates with the case (every metric meets every
d and every k), since the compiled kernels do not depend on it.

The check (:func:`tests.oracle.assert_knn_result`, the float64 difference form, at the tolerance
the backend declares): every row when there are at most ``SAMPLE`` rows, else ``SAMPLE`` rows
spread over the block (the first and last among them) — the CPU oracle over 65,536 x 5,003 x
4,096 would take longer than the search matrix; every row is still checked for distinct valid
indices, best first. Each case is bounded by ``pytest-timeout`` in the device run (the run's
command line) and takes fresh data.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from tests.oracle import assert_knn_result, backend_rtol

try:
    import torch
except ImportError:  # the tests skip with a reason
    torch = None

DIMS = [1, 3, 17, 64, 96, 100, 128, 200, 256, 300, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
KS = [1, 10, 100, 1000]
PRECISIONS = ["fp32", "tf32", "bf16"]
ROWS = [1, 7, 2048, 65_536]
METRICS = ["l2", "sqeuclidean", "inner_product", "cosine"]
N_TARGETS = 5003
SAMPLE = 64
needs_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                                reason="needs a CUDA device (run on the GPU machine: pytest -m gpu)")


def _params():
    for a, d in enumerate(DIMS):
        for b, k in enumerate(KS):
            metric = METRICS[(a + b) % len(METRICS)]
            for precision in PRECISIONS:
                for rows in ROWS:
                    yield pytest.param(d, k, precision, rows, metric,
                                       id=f"d{d}-k{k}-{precision}-rows{rows}-{metric}")


def sample_rows(nq: int) -> np.ndarray:
    """The rows the oracle checks: all of a small block, else SAMPLE spread over it."""
    if nq <= SAMPLE:
        return np.arange(nq)
    return np.unique(np.linspace(0, nq - 1, SAMPLE).round().astype(np.int64))


def _data(nq: int, nt: int, d: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    offset = 0.5 * torch.randn(d, generator=gen, device="cuda")
    q = torch.randn((nq, d), generator=gen, device="cuda") + offset
    t = torch.randn((nt, d), generator=gen, device="cuda") + offset
    return q, t


def check_every_row_is_well_formed(values, indices, nt: int, k: int, metric: str) -> None:
    """All rows, on the device: k distinct indices in [0, nt) (nt > k), values best first."""
    assert bool(((indices >= 0) & (indices < nt)).all()), "an index outside [0, nt)"
    ordered = torch.sort(indices, dim=1).values
    assert bool((ordered[:, 1:] != ordered[:, :-1]).all()), "a repeated index in a row"
    step = values[:, 1:] - values[:, :-1]
    descending = metric in ("cosine", "inner_product")
    assert bool((step <= 0).all() if descending else (step >= 0).all()), "values not best first"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d,k,precision,rows,metric", list(_params()))
def test_gpu_every_shape(d, k, precision, rows, metric):
    from nearest_kernels.gpu import knn_torch

    seed = zlib.crc32(repr((d, k, precision, rows)).encode())
    q, t = _data(rows, N_TARGETS, d, seed)
    try:
        v, i = knn_torch(q, t, k, metric, precision)
        assert v.dtype == torch.float32 and i.dtype == torch.int64 and v.shape == i.shape == (rows, k)
        check_every_row_is_well_formed(v, i, N_TARGETS, k, metric)
        sample = sample_rows(rows)
        pick = torch.from_numpy(sample).to(q.device)
        assert_knn_result(q[pick].cpu().numpy(), t.cpu().numpy(), k, metric, v[pick].cpu().numpy(),
                          i[pick].cpu().numpy(), backend_rtol("gpu"),
                          case=f"gpu {rows} x {N_TARGETS} d={d} {precision} ({sample.size} rows checked)")
    finally:
        del q, t
        torch.cuda.empty_cache()
