"""The cpu and reference backends on adversarial data, against the float64 difference-form
oracle of ``tests/adversarial.py``, under both BLAS kernel selections.

OpenBLAS picks its sgemm kernel at load time: the AVX-512 one by itself on this kind of CPU,
the Haswell one where ``OPENBLAS_CORETYPE=Haswell`` is set (some machines set it because older
builds fail on their CPUs). The kernels round differently (Haswell rounds a column by its
position), and the CPU backend must be exact under either, so the checks run in a subprocess
per setting (started beside the main run: tests/background.py); the suite itself never depends
on what the environment sets.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from nearest_kernels import cpu, knn
from nearest_kernels.segments import knn_probed
from tests import adversarial, background
from tests.oracle import assert_true_topk, backend_rtol

KS = (1, 10, 100)
CASES = adversarial.cases()
RTOL = {name: backend_rtol(name) for name in ("cpu", "reference")}


def _larger_cases():
    """Shapes that span several target tiles (and splits of them between threads), the
    embedding sizes users have, and the issue's shape (copies of targets among the queries)."""
    out = [adversarial.offset_case(d, 10.0, 0.1, nq=60, nt=5000, seed=60 + d) for d in (16, 64, 128)]
    out += [adversarial.offset_case(d, 1e3, 1.0, nq=8, nt=700, seed=70 + d) for d in (768, 1024, 1536)]
    out.append(adversarial.integer_case(8, high=2, nq=300, nt=3000, seed=80))
    return out


def probed_knn(queries, targets, k, metric, threads):
    """knn_probed with the targets cut into segments of uneven sizes (an empty one among
    them), every query probing all of them in a shuffled order: the probed search's heaps
    carried across segments must give every target's true top k."""
    nt = targets.shape[0]
    cuts = sorted({0, nt // 7, nt // 7, nt // 2, nt - nt // 5, nt})
    starts = np.array(cuts, np.int64)
    order = np.random.default_rng(nt).permutation(starts.shape[0] - 1)
    nq = queries.shape[0]
    probe_starts = np.arange(nq + 1, dtype=np.int64) * order.shape[0]
    return knn_probed(queries, targets, starts, probe_starts, np.tile(order, nq), k, metric, threads=threads)


def check_cases(cases, backend: str = "cpu", threads: int = 2, probed_ks=(10, 100)) -> list[str]:
    """Run every case x metric x k; return the failures (one line each). The cpu backend is
    checked twice: knn, and (at ``probed_ks``) its probed search over segments
    (``probed_knn``)."""
    failures = []
    searches = {"reference": lambda q, t, k, m: knn(q, t, k, m, backend="reference")}
    if backend == "cpu":
        searches = {"cpu": lambda q, t, k, m: knn(q, t, k, m, backend="cpu", threads=threads),
                    "cpu probed": lambda q, t, k, m: probed_knn(q, t, k, m, threads)}
    for case in cases:
        for metric in case.metrics:
            for k in KS:
                for name, search in searches.items():
                    if name == "cpu probed" and k not in probed_ks:
                        continue
                    values, indices = search(case.queries, case.targets, k, metric)
                    try:
                        assert_true_topk(case.queries, case.targets, k, metric, values,
                                         indices, RTOL[backend], case=f"{case.name} ({name})")
                    except AssertionError as exc:
                        failures.append(str(exc).splitlines()[0])
    return failures


def _blas_report() -> dict:
    from threadpoolctl import threadpool_info

    cpu.blas_controller()   # loads scipy's BLAS, the one the kernel's sgemm calls
    return {info["filepath"]: info.get("architecture") for info in threadpool_info()
            if info["user_api"] == "blas"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reference_on_adversarial_case(case):
    """The reference backend (the other tests' oracle) agrees with the oracle here."""
    failures = check_cases([case], "reference")
    assert not failures, "\n".join(failures)


def test_cpu_on_one_thread():
    """The subprocess checks below run two threads (target splits, query tiles per thread);
    here one, in this process's BLAS setting."""
    # The probed search at one k here; the subprocesses below check it at two (a heap below
    # the seeding width and one above it).
    failures = check_cases(CASES + _larger_cases(), "cpu", threads=1, probed_ks=(10,))
    assert not failures, "\n".join(failures)


_CHILD = (
    "import json\n"
    "from tests.kernels import test_exactness as t\n"
    "fails = t.check_cases(t.CASES + t._larger_cases())\n"
    "print(json.dumps({'blas': t._blas_report(), 'failures': fails}))\n"
)
_BLAS_SETTINGS = {"blas-default": None, "blas-haswell": "Haswell"}


def _register_blas_suites() -> None:
    """One fresh interpreter per kernel selection (tests/background.py runs them beside the
    main run): OPENBLAS_CORETYPE is removed from the child's environment, then set or not."""
    for name, coretype in _BLAS_SETTINGS.items():
        background.register(name, [sys.executable, "-c", _CHILD],
                            env={"OPENBLAS_CORETYPE": coretype} if coretype else {},
                            unset=("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"), timeout=900)


_register_blas_suites()


@pytest.mark.parametrize("coretype", [
    pytest.param(coretype, id=name, marks=pytest.mark.background(name))
    for name, coretype in _BLAS_SETTINGS.items()])
def test_exact_under_each_blas_kernel(coretype, background_result):
    """The same checks in a fresh interpreter per kernel selection; the child reports the
    kernel OpenBLAS actually loaded, so a setting that did not take effect fails here."""
    done = background_result
    assert done.returncode == 0, done.tail()
    report = json.loads(done.stdout.strip().splitlines()[-1])
    architectures = {str(a).lower() for a in report["blas"].values()}
    if coretype:
        assert architectures == {"haswell"}, report["blas"]
    else:
        assert "haswell" not in architectures or not _has_avx512(), report["blas"]
    assert not report["failures"], "\n".join(report["failures"][:10])


def _has_avx512() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def test_checker_rejects_a_wrong_answer():
    """The oracle check fails on the answers of a kernel that ranks by the float32 expansion
    on offset data (what the cpu backend did before its shifted, exact formulation)."""
    case = adversarial.offset_case(16, 10.0, 0.1, nq=40, nt=500, seed=5)
    q = case.queries.astype(np.float32)
    t = case.targets.astype(np.float32)
    expansion = (q * q).sum(1)[:, None] - 2 * q @ t.T + (t * t).sum(1)[None, :]
    indices = np.argsort(expansion, axis=1, kind="stable")[:, :10].astype(np.int64)
    values = np.sqrt(np.maximum(np.take_along_axis(expansion, indices, axis=1), 0)).astype(np.float32)
    with pytest.raises(AssertionError, match="rows wrong"):
        assert_true_topk(q, t, 10, "l2", values, indices, cpu.RANK_TOLERANCE)


def test_extreme_magnitudes_keep_every_row_and_overflow_only_past_float32():
    """float32 elements ~1e20: every query keeps its k rows; l2 values stay finite (~1e20),
    sqeuclidean ones (~1e40) are +inf, as documented; ~1e-24: no row collapses to 0."""
    case = adversarial.magnitude_case(1e20, d=4, nq=5, nt=50, seed=9)
    l2, idx = knn(case.queries, case.targets, 3, "l2", backend="cpu")
    sq, idx2 = knn(case.queries, case.targets, 3, "sqeuclidean", backend="cpu")
    assert (idx >= 0).all() and (idx == idx2).all()
    assert np.isfinite(l2).all() and (l2[:, 1:] > 1e19).all()
    assert np.isinf(sq[:, 1:]).all()
    tiny = adversarial.magnitude_case(1e-24, d=4, nq=5, nt=50, seed=9)
    v, i = knn(tiny.queries, tiny.targets, 3, "l2", backend="cpu")
    assert (i >= 0).all() and (v[:, 1:] > 1e-25).all()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_rows_whose_values_read_the_same_float32_come_in_their_float64_order(backend):
    """Nearly parallel vectors: every cosine reads 1.0 in float32, and the rows still come in
    the order of their float64 cosines (docs/exactness.md), not in block order."""
    rng = np.random.default_rng(3)
    base = rng.standard_normal(16)
    targets = (base + 1e-5 * rng.standard_normal((40, 16))).astype(np.float32)
    query = base[None, :].astype(np.float32)
    values, idx = knn(query, targets, 8, "cosine", backend=backend)
    assert (values == np.float32(1.0)).all()
    t64, q64 = targets.astype(np.float64), query[0].astype(np.float64)
    cosines = t64 @ q64 / (np.linalg.norm(t64, axis=1) * np.linalg.norm(q64))
    assert idx[0].tolist() == np.argsort(-cosines, kind="stable")[:8].tolist()
    assert idx[0].tolist() != sorted(idx[0].tolist())   # block order would differ
