"""knn() on every backend against the float64 difference-form oracle, and its edge cases.

Every result goes through :func:`tests.oracle.assert_knn_result`: the true top k of the oracle
(independent of the reference backend's code, so the reference is checked, not compared with
itself), ties within the tolerance the backend declares next to its code, values to float32
rounding, missing slots -1 and the metric's worst value.

Backends: each one with code of its own. ``"auto"`` is not a backend: it runs the first one in
:func:`backend_names` order that accepts the input, so it joins the lists only where it picks
another one than ``"cpu"`` (a CUDA machine); what it picks is tested by the dispatcher tests.
"""
from __future__ import annotations

import concurrent.futures
import doctest
import importlib
import os
import zlib
from pathlib import Path

import numba
import numpy as np
import pytest
from threadpoolctl import threadpool_info

from nearest_kernels import METRICS, backend_names, choose_backend, knn
from nearest_kernels import dispatch as dispatch_module
from nearest_kernels import merge as merge_module
from nearest_kernels.reference import knn_reference
from tests.oracle import assert_knn_result, backend_rtol

GOOD = np.zeros((2, 3), dtype=np.float32)
BACKENDS = ["cpu", "reference"] + (
    ["auto"] if choose_backend(GOOD, GOOD, 1, METRICS["l2"], "auto").name != "cpu" else [])


def seeded_rng(request) -> np.random.Generator:
    """A generator seeded by the test id: reproducible, yet different data for every case."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def check_knn(queries, targets, k, metric, values, indices, backend: str) -> None:
    """The oracle's check at the tolerance of the backend that ran this call."""
    chosen = choose_backend(queries, targets, k, METRICS[metric], backend)
    assert_knn_result(queries, targets, k, metric, values, indices, backend_rtol(chosen.name),
                      case=f"{chosen.name} {queries.shape} x {targets.shape}")


def random_matrix(rng, rows, d, dtype, layout):
    """Gaussian rows with a random scale and offset (offsets exercise the L2 cancellation)."""
    data = rng.standard_normal((rows, d)) * rng.uniform(0.5, 4.0) + rng.uniform(-2.0, 2.0)
    if layout == "C":
        return np.ascontiguousarray(data, dtype=dtype)
    if layout == "F":  # a transposed view: column-major storage
        return np.asfortranarray(data, dtype=dtype)
    wide = np.empty((rows, 2 * d), dtype=dtype)  # "strided": every other column of a wider array
    wide[:, ::2] = data
    wide[:, 1::2] = np.nan
    return wide[:, ::2]


# nq and nt are not multiples of any tile size; 2053 targets span several target tiles with a
# padded tail (cpu: 512-target tiles) and 1031 queries make one query tile per thread.
SHAPES = [(37, 2053), (1031, 101), (257, 1031), (3, 37)]
K_CASES = {"k1": 1, "k10": 10, "k100": 100, "k_gt_nt": None}


@pytest.mark.parametrize("layout", ["C", "noncontiguous"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("k_case", list(K_CASES))
@pytest.mark.parametrize("d", [1, 3, 31, 33, 128])
@pytest.mark.parametrize("metric", list(METRICS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference(request, backend, metric, d, k_case, dtype, layout):
    rng = seeded_rng(request)
    nq, nt = SHAPES[rng.integers(len(SHAPES))]
    k = K_CASES[k_case] or nt + int(rng.integers(1, 20))
    queries = random_matrix(rng, nq, d, dtype, "F" if layout != "C" else "C")
    targets = random_matrix(rng, nt, d, dtype, "strided" if layout != "C" else "C")
    assert layout == "C" or not targets.flags.c_contiguous
    values, indices = knn(queries, targets, k, metric, backend=backend, threads=2)
    check_knn(queries, targets, k, metric, values, indices, backend)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("metric", list(METRICS))
def test_cpu_few_queries_split_targets(request, metric, threads):
    """One or two queries against many targets: the cpu kernel splits the targets between
    threads and merges the per-split heaps; the answer must not depend on the split."""
    rng = seeded_rng(request)
    for nq in (1, 2):
        queries = random_matrix(rng, nq, 17, "float32", "C")
        targets = random_matrix(rng, 5000, 17, "float32", "C")
        values, indices = knn(queries, targets, 50, metric, backend="cpu", threads=threads)
        check_knn(queries, targets, 50, metric, values, indices, "cpu")


def test_cpu_result_does_not_depend_on_threads(request):
    rng = seeded_rng(request)
    queries = random_matrix(rng, 700, 24, "float32", "C")
    targets = random_matrix(rng, 3000, 24, "float32", "C")
    one = knn(queries, targets, 20, "l2", backend="cpu", threads=1)
    two = knn(queries, targets, 20, "l2", backend="cpu", threads=2)
    np.testing.assert_array_equal(one[1], two[1])
    np.testing.assert_array_equal(one[0], two[0])


@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "inner_product"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_ties_go_to_lower_index(request, backend, metric):
    """Small integers make every float32 sum exact, so the data is full of exact ties (and
    duplicate rows across all three target tiles): the tie rule alone decides the order."""
    rng = seeded_rng(request)
    queries = rng.integers(-2, 3, size=(60, 6)).astype(np.float32)
    targets = rng.integers(-2, 3, size=(3000, 6)).astype(np.float32)
    targets[[10, 1500, 2990]] = targets[700]
    values, indices = knn(queries, targets, 40, metric, backend=backend, threads=2)
    ref_v, ref_i = knn_reference(queries, targets, 40, METRICS[metric])
    np.testing.assert_array_equal(indices, ref_i)
    np.testing.assert_array_equal(values, ref_v)


def test_query_tiles_start_at_the_same_rows_for_any_thread_count():
    """Some sgemm kernels (OpenBLAS Haswell) round a row by its position in the call: query
    tiles start at multiples of QUERY_TILE_MULTIPLE, so a row's position does not depend on
    the number of threads (test_cpu_result_does_not_depend_on_threads checks the bits where
    such a kernel runs)."""
    from nearest_kernels import cpu

    for nq in (1, 63, 130, 700, 1000, 4000, 9999):
        for threads in (1, 2, 3, 8):
            query_tile, _, n_split = cpu.plan_tiles(nq, 3000, threads)
            if n_split == 1 and query_tile < nq:
                assert query_tile % cpu.QUERY_TILE_MULTIPLE == 0, (nq, threads, query_tile)
            tiles = -(-nq // query_tile)
            assert tiles * query_tile - nq < query_tile, (nq, threads)   # no empty tile
    assert cpu.QUERY_TILE_MULTIPLE % 12 == 0   # the period measured with the Haswell kernel


def _count_rescans(monkeypatch):
    """Count the rows the exact stage searches again: (collected, scanned), the rows searched
    keeping every target that can be within their k-th key, and those then searched in float64
    against every target."""
    from nearest_kernels import cpu

    collected, scanned = [], []
    real_collect, real_scan = cpu._Operands.collect_rows, cpu._Operands.search_rows

    def collect_spy(self, unproven, *args):
        collected.extend(unproven.tolist())
        return real_collect(self, unproven, *args)

    def scan_spy(self, unproven, width):
        scanned.extend(unproven.tolist())
        return real_scan(self, unproven, width)

    monkeypatch.setattr(cpu._Operands, "collect_rows", collect_spy)
    monkeypatch.setattr(cpu._Operands, "search_rows", scan_spy)
    return collected, scanned


@pytest.mark.parametrize("metric", list(METRICS))
def test_cpu_searches_again_rows_whose_ties_outnumber_the_kept_candidates(request, metric, monkeypatch):
    """40 copies of one row (and 40 near copies, a float32 ulp apart) outnumber the heap's
    k + margin slots: the kept scores cannot prove which copies rank, so that row is searched
    again keeping every target that can be within its k-th key (all the copies), and the
    lowest indices win; no float64 scan is needed. A row far from the copies is proven at once."""
    from nearest_kernels import cpu

    collected, scanned = _count_rescans(monkeypatch)
    rng = seeded_rng(request)
    d = 16
    targets = rng.standard_normal((3000, d)).astype(np.float32)
    row = (3 * rng.standard_normal(d)).astype(np.float32)
    copies = np.sort(rng.choice(3000, 40, replace=False))
    targets[copies] = row
    near = np.setdiff1d(rng.choice(3000, 60, replace=False), copies)[:40]
    if metric != "cosine":   # (cosine ranks float32 unit rows: near copies may merge there)
        targets[near] = np.nextafter(row, np.float32(np.inf))
    queries = np.stack([row + np.float32(1e-3), -row]).astype(np.float32)
    k = 5
    assert cpu.heap_width(k, 3000) < 40
    values, indices = knn(queries, targets, k, metric, backend="cpu", threads=2)
    ref_v, ref_i = knn_reference(queries, targets, k, METRICS[metric])
    assert collected == [0] and scanned == [], (collected, scanned)     # row 0 only
    assert np.isin(indices[0], np.concatenate([copies, near])).all()
    np.testing.assert_array_equal(indices, ref_i)
    np.testing.assert_allclose(values, ref_v, rtol=1e-5, atol=1e-5)


def test_cpu_proves_ordinary_rows_without_rescans(request, monkeypatch):
    collected, scanned = _count_rescans(monkeypatch)
    rng = seeded_rng(request)
    queries = rng.standard_normal((300, 24)).astype(np.float32)
    targets = rng.standard_normal((5000, 24)).astype(np.float32)
    for metric in METRICS:
        values, indices = knn(queries, targets, 10, metric, backend="cpu", threads=2)
        ref_v, ref_i = knn_reference(queries, targets, 10, METRICS[metric])
        np.testing.assert_array_equal(indices, ref_i)
    assert not collected and not scanned


@pytest.mark.parametrize("metric", list(METRICS))
@pytest.mark.parametrize("k", [1, 10, 100])
@pytest.mark.parametrize("nq", [3, 300])
def test_cpu_exact_stage_matches_the_reference(request, metric, k, nq, monkeypatch):
    """The exact stage against the reference: Gaussian rows with exact copies mixed in
    (ties to the lower index), few queries (target splits) and many."""
    _count_rescans(monkeypatch)
    rng = seeded_rng(request)
    targets = rng.standard_normal((2500, 12)).astype(np.float32)
    targets[rng.choice(2500, 200)] = targets[rng.choice(2500, 200)]
    queries = np.concatenate([rng.standard_normal((nq - 1, 12)), targets[[7]]]).astype(np.float32)
    values, indices = knn(queries, targets, k, metric, backend="cpu", threads=2)
    ref_v, ref_i = knn_reference(queries, targets, k, METRICS[metric])
    np.testing.assert_array_equal(indices, ref_i)
    np.testing.assert_allclose(values, ref_v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nq", [1, 40])
@pytest.mark.parametrize("metric", list(METRICS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_targets_in_different_tiles(request, backend, metric, nq):
    """Copies of one row in three different target tiles (and, for nq=1, different
    thread splits) tie exactly; the lowest index must come first, in index order."""
    rng = seeded_rng(request)
    d = 20
    targets = rng.standard_normal((4100, d)).astype(np.float32)
    copies = [3000, 1023, 2047, 4099]  # the original last: rank must follow index, not order
    # A long copied row, queries close to it: its copies are the top four for every metric
    # (other targets have norm ~sqrt(d) and project ~N(0, 1) onto its direction).
    targets[copies[0]] *= 10.0 / np.linalg.norm(targets[copies[0]]) * np.sqrt(d) / 4
    targets[copies[1:]] = targets[copies[0]]
    queries = (targets[copies[0]] + 0.01 * rng.standard_normal((nq, d))).astype(np.float32)
    values, indices = knn(queries, targets, 6, metric, backend=backend, threads=2)
    expected = sorted(copies)
    np.testing.assert_array_equal(indices[:, :4], np.tile(expected, (nq, 1)))
    np.testing.assert_array_equal(values[:, :4], np.repeat(values[:, :1], 4, axis=1))
    assert not np.isin(indices[:, 4:], copies).any()


@pytest.mark.parametrize("metric", list(METRICS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_infinite_rows_never_match(request, backend, metric):
    rng = seeded_rng(request)
    queries = rng.standard_normal((30, 5))
    targets = rng.standard_normal((200, 5))
    queries[[3, 17]] = np.nan
    queries[5, 2] = np.inf
    targets[[0, 50, 199]] = np.nan
    targets[7, 4] = -np.inf
    values, indices = knn(queries, targets, 210, metric, backend=backend, threads=2)
    worst = METRICS[metric].worst
    for row in (3, 5, 17):
        assert (indices[row] == -1).all() and (values[row] == worst).all()
    bad_targets = [0, 7, 50, 199]
    assert not np.isin(indices, bad_targets).any()
    # Each good query ranks all 196 good targets, then 14 missing slots.
    good = np.setdiff1d(np.arange(30), [3, 5, 17])
    assert (indices[good, :196] >= 0).all() and (indices[good, 196:] == -1).all()
    assert (values[good, 196:] == worst).all()
    keep = np.setdiff1d(np.arange(200), bad_targets)
    sub_v, sub_i = values[good], indices[good]
    remapped = np.where(sub_i >= 0, np.searchsorted(keep, np.maximum(sub_i, 0)), -1)
    check_knn(queries[good], targets[keep], 210, metric, sub_v, remapped, backend)


@pytest.mark.parametrize("metric", list(METRICS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_vectors_excluded_for_cosine_only(backend, metric):
    queries = np.array([[0.0, 0.0], [1.0, 0.0]], dtype=np.float32)
    targets = np.array([[0.0, 0.0], [2.0, 0.0], [0.0, 3.0]], dtype=np.float32)
    values, indices = knn(queries, targets, 3, metric, backend=backend)
    if metric == "cosine":
        assert indices.tolist() == [[-1, -1, -1], [1, 2, -1]]
        assert values.tolist() == [[-np.inf] * 3, [1.0, 0.0, -np.inf]]
    else:
        assert (indices >= 0).all()
        assert 0 in indices[0].tolist() and 0 in indices[1].tolist()
    if metric == "l2":
        assert indices.tolist() == [[0, 1, 2], [0, 1, 2]]
        assert values.tolist() == [[0.0, 2.0, 3.0], [1.0, 1.0, np.sqrt(10.0).astype(np.float32)]]


@pytest.mark.parametrize("metric", list(METRICS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fewer_targets_than_k_pad_with_missing_slots(backend, metric):
    queries = np.array([[1.0, 1.0]], dtype=np.float64)
    targets = np.array([[1.0, 2.0], [3.0, 1.0], [-1.0, 1.0]], dtype=np.float64)
    values, indices = knn(queries, targets, 5, metric, backend=backend)
    # q = (1, 1). l2: t0 at 1, t1 and t2 both at 2 (tie: lower index first). inner product:
    # 3, 4, 0. cosine: 3/sqrt(10), 4/sqrt(20) = 2/sqrt(5), 0.
    expected = {
        "l2": ([1.0, 2.0, 2.0], [0, 1, 2]),
        "sqeuclidean": ([1.0, 4.0, 4.0], [0, 1, 2]),
        "inner_product": ([4.0, 3.0, 0.0], [1, 0, 2]),
        "cosine": ([3 / np.sqrt(10), 2 / np.sqrt(5), 0.0], [0, 1, 2]),
    }
    worst = METRICS[metric].worst
    expect_v, expect_i = expected[metric]
    assert indices.tolist() == [expect_i + [-1, -1]]
    np.testing.assert_allclose(values[0, :3], expect_v, rtol=1e-6, atol=1e-6)
    assert values[0, 3:].tolist() == [worst, worst]


@pytest.mark.parametrize("k", [1000, 100_000])
def test_cpu_large_k(request, k):
    """k far above the number of targets, and k = 100000 over more targets than that."""
    rng = seeded_rng(request)
    nt = 300 if k == 1000 else 120_000
    queries = rng.standard_normal((3, 4)).astype(np.float32)
    targets = rng.standard_normal((nt, 4)).astype(np.float32)
    values, indices = knn(queries, targets, k, "sqeuclidean", backend="cpu", threads=2)
    check_knn(queries, targets, k, "sqeuclidean", values, indices, "cpu")


def test_cpu_accepts_and_ignores_other_backends_options():
    queries = np.eye(3, dtype=np.float32)
    values, indices = knn(queries, queries, 1, "l2", backend="cpu", precision="bf16", device=0)
    assert indices[:, 0].tolist() == [0, 1, 2]
    assert values[:, 0].tolist() == [0.0, 0.0, 0.0]


# --- argument errors -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda b: knn(GOOD, np.zeros((2, 4), np.float32), 1, backend=b),
         r"targets: expected dimension 3 .*got 4"),
        (lambda b: knn(GOOD, GOOD, 0, backend=b), r"k: expected an integer >= 1, got 0"),
        (lambda b: knn(GOOD, GOOD, -1, backend=b), r"k: expected an integer >= 1, got -1"),
        (lambda b: knn(GOOD, GOOD, 1.5, backend=b), r"k: expected an integer >= 1, got 1.5"),
        (lambda b: knn(GOOD, GOOD, True, backend=b), r"k: expected an integer >= 1, got True"),
        (lambda b: knn(GOOD, GOOD, 1, "manhattan", backend=b),
         r"metric: expected one of .*'cosine'.*got 'manhattan'"),
        (lambda b: knn(np.zeros(3, np.float32), GOOD, 1, backend=b),
         r"queries: expected a 2-D array .*got shape \(3,\)"),
        (lambda b: knn(GOOD, np.zeros((1, 2, 3), np.float32), 1, backend=b),
         r"targets: expected a 2-D array .*got shape \(1, 2, 3\)"),
        (lambda b: knn(GOOD.astype(np.int64), GOOD, 1, backend=b),
         r"queries: expected dtype float32 or float64, got int64"),
        (lambda b: knn(GOOD, GOOD.astype(np.int32), 1, backend=b),
         r"targets: expected dtype float32 or float64, got int32"),
    ],
    ids=["dimension", "k0", "k-1", "k1.5", "kTrue", "metric", "queries1d", "targets3d",
         "queries_int", "targets_int"],
)
def test_bad_arguments_raise_value_error(call, match, backend):
    with pytest.raises(ValueError, match=match):
        call(backend)


def test_unknown_backend_raises_value_error():
    with pytest.raises(ValueError, match=r"backend: expected one of \['auto', .*'cpu'.*got 'tpu'"):
        knn(GOOD, GOOD, 1, backend="tpu")


def test_threads_that_load_a_backend_at_once_all_get_it(tmp_path, monkeypatch):
    """A backend whose import takes a while, asked for by several threads at once (a driver
    searching beside its kernel warm-up thread): each gets the backend, none reads the import
    under way as a failure."""
    (tmp_path / "slow_backend_for_test.py").write_text(
        "import time\ntime.sleep(0.3)\nfrom nearest_kernels.reference_backend import BACKEND\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(dispatch_module, "_REGISTRY", dict(dispatch_module._REGISTRY))
    dispatch_module.register_backend("slow", "slow_backend_for_test")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = [f.result() for f in [pool.submit(dispatch_module.get_backend, "slow") for _ in range(4)]]
    assert all(backend is got[0] for backend in got) and got[0].name == "reference"


@pytest.mark.parametrize("threads", [0, -2, 1.5, True, "2"])
def test_cpu_bad_threads_raise_value_error(threads):
    with pytest.raises(ValueError, match=rf"threads: expected an integer >= 1, got {threads!r}"):
        knn(GOOD, GOOD, 1, backend="cpu", threads=threads)


# --- threads -----------------------------------------------------------------------------------

def blas_threads(paths=None) -> dict[str, int]:
    """Thread count of every loaded BLAS (or of those at ``paths``), by library path."""
    return {lib["filepath"]: lib["num_threads"] for lib in threadpool_info()
            if lib["user_api"] == "blas" and (paths is None or lib["filepath"] in paths)}


def test_cpu_honours_threads_and_restores_settings(monkeypatch):
    """Inside the kernel the rows are split over ``threads`` threads and BLAS runs one (each
    kernel thread calls its own sgemm); afterwards BLAS is back to what it was. Checked by
    wrapping the kernel entry, not by timing."""
    cpu = importlib.import_module("nearest_kernels.cpu")
    kernels = importlib.import_module("nearest_kernels._cpu_kernels")
    numba_setup = importlib.import_module("nearest_kernels._numba")
    # The BLAS the kernel calls is scipy's (numba's np.dot binds to scipy.linalg.cython_blas).
    controlled = {lib["filepath"] for lib in cpu.blas_controller().info()}
    assert any("scipy" in path and "numpy" not in path for path in controlled), controlled
    before_blas = blas_threads()
    seen = []
    real = kernels._search_items
    ranges = []

    def spy(lo, hi, *args):
        ranges.append((lo, hi))
        return real(lo, hi, *args)

    def entry(*args, **kwargs):
        seen.append((numba_setup.threads_of_task(), blas_threads(controlled)))
        return real_entry(*args, **kwargs)

    real_entry = kernels.search_tiles
    monkeypatch.setattr(kernels, "search_tiles", entry)
    monkeypatch.setattr(kernels, "_search_items", spy)
    queries = np.random.default_rng(0).standard_normal((300, 8)).astype(np.float32)
    for threads in (1, 3):
        ranges.clear()
        knn(queries, queries, 5, "l2", backend="cpu", threads=threads)
        assert seen[-1][0] == threads
        assert set(seen[-1][1]) == controlled and set(seen[-1][1].values()) == {1}
        assert len(ranges) == threads and sorted(ranges)[0][0] == 0   # the items, split in ranges
        assert numba_setup.threads_of_task() == 1
        assert blas_threads() == before_blas
    # Without threads=, the kernel uses the CPUs this process may run on.
    knn(queries, queries, 5, "l2", backend="cpu")
    assert seen[-1][0] == cpu.default_threads()


def test_cpu_threads_are_restored_after_an_error(monkeypatch):
    kernels = importlib.import_module("nearest_kernels._cpu_kernels")
    numba_setup = importlib.import_module("nearest_kernels._numba")
    before_blas = blas_threads()

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(kernels, "search_tiles", broken)
    with pytest.raises(RuntimeError, match="kernel failed"):
        knn(GOOD, GOOD, 1, backend="cpu", threads=2)
    assert numba_setup.threads_of_task() == 1
    assert blas_threads() == before_blas


# --- compilation cache --------------------------------------------------------------------------

def test_numba_cache_moves_to_home_when_package_dir_is_read_only(monkeypatch, tmp_path):
    """Executors often install the package read-only; numba's cache must still persist."""
    setup = importlib.import_module("nearest_kernels._numba")
    package_dir = os.path.dirname(os.path.abspath(setup.__file__))
    real_access = os.access
    monkeypatch.setattr(os, "access",
                        lambda path, mode: path != package_dir and real_access(path, mode))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)
    setup.ensure_numba_cache_dir()
    expected = tmp_path / ".cache" / "nearest_join" / "numba"
    assert os.environ["NUMBA_CACHE_DIR"] == str(expected) and expected.is_dir()
    assert numba.config.CACHE_DIR == str(expected)


def test_explicit_numba_cache_dir_wins(monkeypatch, tmp_path):
    setup = importlib.import_module("nearest_kernels._numba")
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    setup.ensure_numba_cache_dir()
    assert os.environ["NUMBA_CACHE_DIR"] == str(tmp_path / "mine")


# --- registry and docs -------------------------------------------------------------------------

def test_auto_prefers_cpu_over_reference():
    names = backend_names()
    assert names.index("cpu") < names.index("reference")
    chosen = choose_backend(GOOD, GOOD, 1, METRICS["l2"], "auto")
    assert chosen.name != "reference"


def test_cpu_backend_declares_what_it_supports():
    cpu = importlib.import_module("nearest_kernels.cpu").BACKEND
    assert cpu.name == "cpu" and cpu.devices == ("cpu",)
    assert set(cpu.metrics) == set(METRICS) and set(cpu.dtypes) == {"float32", "float64"}
    assert cpu.max_k is None
    assert cpu.refuse(GOOD, GOOD, 100_000, METRICS["cosine"]) is None


@pytest.mark.parametrize("module", [dispatch_module, merge_module], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0


def test_numba_is_first_imported_through_one_lock():
    """Every module of ours that imports numba calls kernels.import_numba first (one thread
    at a time: two threads' first imports of numba at once can leave one of them a partially
    initialised numba module), the warm-up thread included."""
    import ast

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in sorted((root / "nearest_join").rglob("*.py")) + sorted((root / "udfs").rglob("*.py")):
        if path.name == "_numba.py":
            continue
        tree = ast.parse(path.read_text())
        scopes = [tree] + [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for scope in scopes:
            called = False
            for node in (scope.body if scope is tree else ast.walk(scope)):
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                        and getattr(node.value.func, "id", None) == "import_numba":
                    called = True
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "numba" \
                        and not called:
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, offenders
