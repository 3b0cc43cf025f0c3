"""mode="approx" (issue 23): recall@k and time of the IVF plan against our exact mode and faiss in Spark
``local[2]``, on clustered, Gaussian or real (``benchmarks/embeddings.py``) data: tables ``recall_*``;
``--seeds N``: recall honesty over N seeds per target (``seeds_*``); ``--ceiling``: the indexes' kernels alone,
no Spark (``ceiling_*``); ``--fresh``: each engine's first call in a fresh session (``fresh_*``). What each
table measures: its text in ``benchmarks/report.py``.

Usage: python benchmarks/approx.py [--quick | --full] [--datasets clustered gaussian minilm] [--blocked]
       python benchmarks/approx.py --seeds 10 --datasets minilm clustered
       python benchmarks/approx.py --ceiling | --fresh --datasets minilm [--profile local]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import os
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._record import (SMOKE_DIR, Recorder, cached_parquet, local_spark, process_tree, sampling,
                                vector_table)

D, K, METRIC = 128, 10, "l2"
ROWS_PER_CLUSTER = 1000
RECALLS = (0.9, 0.95, 0.99)
MINILM_ROWS = 64_000     # the real embeddings' rows (benchmarks/embeddings.py), joined with themselves


def make_data(kind: str, nt: int, nq: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(targets, queries). ``minilm``: a self-join of ``nt`` real sentence embeddings
    (benchmarks/embeddings.py; d=384, unit rows, their duplicates kept)."""
    rng = np.random.default_rng(seed)
    if kind == "minilm":
        from benchmarks.embeddings import load

        vectors = load(nt)
        return vectors, vectors
    if kind == "gaussian":
        return (rng.standard_normal((nt, D), dtype=np.float32),
                rng.standard_normal((nq, D), dtype=np.float32))
    centres = rng.standard_normal((max(1, nt // ROWS_PER_CLUSTER), D), dtype=np.float32)

    def draw(n):
        return centres[rng.integers(0, centres.shape[0], n)] + 0.35 * rng.standard_normal((n, D), dtype=np.float32)

    return draw(nt), draw(nq)


def cached_inputs(spark, kind: str, nt: int, nq: int, workdir: str):
    """(targets, queries, t, q, metric): the arrays, and the DataFrames of their Parquet files
    (``tid``, ``w``; ``qid``, ``v``), cached. Real embeddings join by cosine, as sentence
    embeddings are; the synthetic data by ``METRIC``."""
    def cached(matrix, ids: str, vectors: str):
        table = vector_table(np.arange(matrix.shape[0], dtype=np.int32), matrix, ids, vectors)
        return cached_parquet(spark, os.path.join(workdir, f"{kind}-{ids[0]}.parquet"), table, 50_000)

    targets, queries = make_data(kind, nt, nq)
    metric = "cosine" if kind == "minilm" else METRIC
    return targets, queries, cached(targets, "tid", "w"), cached(queries, "qid", "v"), metric


def exact_or_approx(q, t, metric: str, **options):
    """The planned join of our k nearest (``qid``, ``tid``, ``value``) rows, without the vector
    columns (``keep_vectors=False``): faiss returns ids and values, and an engine that carried
    both sides' vectors into every output row would be timing that transfer, not its search."""
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions

    return plan_join(q, t, metric, JoinOptions(num_results=K, vectors=("v", "w"), distance_col="value",
                                               keep_vectors=False, **options))


@contextlib.contextmanager
def cpu_meter():
    """CPU seconds (user + system) of this process and its descendants (the Spark JVM, its Python
    daemon and workers) while the block runs, sampled every 0.2 s per process (a Python worker
    Spark ends mid-call keeps what it had used at its last sample). A ratio of these holds while
    other work loads the machine, when a ratio of wall times does not."""
    tick = os.sysconf("SC_CLK_TCK")

    def tree() -> dict:   # {(pid, start time): CPU seconds}
        return {(pid, f[19]): (int(f[11]) + int(f[12])) / tick for pid, f in process_tree(os.getpid()).items()}
    first, last, meter = tree(), {}, types.SimpleNamespace()
    with sampling(lambda: last.update(tree())):
        yield meter
    meter.seconds = sum(v - first.get(key, 0.0) for key, v in last.items())


def pairs_of(df) -> np.ndarray:
    """(query id, target id, value) rows (float64), sorted by query, then target id."""
    table = df.toArrow()
    rows = np.stack([table.column(i).to_numpy().astype(np.float64) for i in range(3)], axis=1)
    return rows[np.lexsort((rows[:, 1], rows[:, 0]))]


def result_rows(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(query, target, value) rows (float64) of a search's (queries, k) arrays; id -1: no row."""
    keep = ids >= 0
    queries = np.repeat(np.arange(ids.shape[0]), ids.shape[1])
    return np.stack([queries[keep.ravel()], ids[keep], values[keep]], axis=1).astype(np.float64)


def recall_of(found: np.ndarray, exact: np.ndarray, nq: int, descending: bool = False) -> float:
    """Mean over queries of the share of their exact neighbours that ``found`` matches, ties
    included: a found row counts when its value is at least as near as the query's k-th exact
    value (the values are exact in both: a query with more tied neighbours than k, such as
    duplicated rows, may return any of them). Rows are (query, target, value)."""
    sign = -1.0 if descending else 1.0
    queries = exact[:, 0].astype(np.int64)
    wanted = np.bincount(queries, minlength=nq)
    kth = np.full(nq, -np.inf)
    np.maximum.at(kth, queries, sign * exact[:, 2])          # the k-th (farthest kept) exact value
    tolerance = 1e-6 * np.maximum(1.0, np.abs(kth))
    by = found[:, 0].astype(np.int64)
    near = sign * found[:, 2] <= (kth + tolerance)[by]
    hits = np.minimum(np.bincount(by, weights=near, minlength=nq), wanted)
    return float(np.mean(hits / np.maximum(wanted, 1)))


def faiss_at_recall(targets, queries, exact: np.ndarray, nlist: int, sample_rows: int,
                    wanted: float, metric: str = METRIC) -> tuple[int, float, float]:
    """(nprobe, recall, seconds) of faiss IVFFlat: the smallest nprobe reaching ``wanted``
    (recall as :func:`recall_of` measures ours). Cosine: inner product over unit rows."""
    import faiss

    faiss.omp_set_num_threads(2)
    rng = np.random.default_rng(0)
    d = targets.shape[1]
    sample = targets[rng.choice(targets.shape[0], min(sample_rows, targets.shape[0]), replace=False)]
    start = time.perf_counter()
    cosine = metric == "cosine"
    quantizer = (faiss.IndexFlatIP if cosine else faiss.IndexFlatL2)(d)
    index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT if cosine else faiss.METRIC_L2)
    index.train(sample)
    index.add(targets)
    build = time.perf_counter() - start
    nq = queries.shape[0]

    def at(nprobe: int) -> tuple[float, float]:
        index.nprobe = nprobe
        start = time.perf_counter()
        values, found = index.search(queries, K)
        seconds = time.perf_counter() - start
        rows = result_rows(values if cosine else np.sqrt(np.maximum(values, 0)), found)
        return recall_of(rows, exact, nq, descending=cosine), seconds

    # Doubling, then bisection: the smallest nprobe reaching ``wanted``.
    low, high, seen = 0, 1, {}
    while True:
        seen[high] = at(high)
        if seen[high][0] >= wanted or high >= nlist:
            break
        low, high = high, min(nlist, 2 * high)
    while high - low > 1:
        middle = (low + high) // 2
        seen[middle] = at(middle)
        low, high = (low, middle) if seen[middle][0] >= wanted else (middle, high)
    recall, search = seen[high]
    return high, recall, build + search


def run_dataset(spark, rec: Recorder, kind: str, nt: int, nq: int, recalls, workdir: str,
                force: bool = False, repeat: int = 1, blocked: bool = False) -> None:
    """Table ``recall_nt<nt>`` (``recall_minilm<nt>``): exact, then approx per recall target
    (``force``: the IVF plan at a size below the one where approx runs it), against faiss;
    ``blocked``: every call with ``broadcast_limit_bytes=0`` (table ``..._blocked``)."""
    from nearest_join.ivf_index import default_nlist

    targets, queries, t, q, metric = cached_inputs(spark, kind, nt, nq, workdir)
    table = (f"recall_minilm{nt}" if kind == "minilm" else f"recall_nt{nt}") + ("_blocked" if blocked else "")
    plan_options = {"broadcast_limit_bytes": 0} if blocked else {}
    common = {"data": kind, "nt": nt, "nq": nq, "d": targets.shape[1], "k": K, "metric": metric, "master": "local[2]"}

    def timed_once(**options):
        """(pairs, seconds, CPU seconds, plan, planning seconds): planning is the facts job and,
        for an approx plan, the sample, k-means and the recall estimate."""
        start = time.perf_counter()
        with cpu_meter() as cpu:
            planned = exact_or_approx(q, t, metric, **plan_options, **options)
            planning = time.perf_counter() - start
            pairs = pairs_of(planned.dataframe().select("qid", "tid", "value"))
        return pairs, time.perf_counter() - start, cpu.seconds, planned.plan, planning

    def timed(**options):
        """The fastest of ``repeat`` :func:`timed_once` calls, and every call's seconds."""
        calls = [timed_once(**options) for _ in range(repeat)]
        best = min(calls, key=lambda c: c[1])
        return (*best, [round(c[1], 2) for c in calls])

    # warm-up (Python workers, numba caches, both plans, the recall estimate) on a slice
    for options in ({}, {"mode": "approx", "nlist": 8, "nprobe": 2}, {"mode": "approx", "nlist": 8}):
        exact_or_approx(q.limit(500), t.limit(5000), metric, **plan_options, **options).dataframe().toArrow()
    load = lambda: round(os.getloadavg()[0], 1)
    before = load()
    exact, exact_s, exact_cpu, exact_plan, exact_plan_s, exact_runs = timed()
    rec.add(table, engine="nearest_by_join exact", recall_target=None, ran="exact", nprobe=None, plan=exact_plan.plan,
            recall_estimate=None, recall=1.0, seconds=round(exact_s, 2), plan_seconds=round(exact_plan_s, 2),
            speedup_vs_exact=1.0, cpu_seconds=round(exact_cpu, 1), cpu_vs_exact=1.0, load_1min=[before, load()],
            faiss_seconds=None, ours_over_faiss=None, runs=exact_runs, **common)
    forced = {"nlist": default_nlist(nt, nq)} if force else {}
    # One untimed call of the approx plan at full size: a slice does not warm what the first
    # full-size calls pay (the JVM's compiled code for the large loops, fresh memory in the
    # JVM and the Python workers); without it the first approx calls ran slower than the
    # later calls of the same plan, and the first recall row paid for all of them.
    # Exact needs none: its calls are long, and its first full call is one of its repeats; nor
    # does the Gaussian's approx call, which runs the exact plan.
    if kind != "gaussian":
        timed_once(mode="approx", **forced)

    def approx_rows(engine: str, faiss_too: bool, wanteds=recalls, **options) -> None:
        for wanted in wanteds:   # (None: no recall target, nprobe given)
            before = load()
            found, seconds, cpu, planned_plan, plan_s, runs = timed(
                mode="approx", **({} if wanted is None else {"recall": wanted}), **options)
            plan = planned_plan.ivf
            measured = recall_of(found, exact, nq, descending=metric == "cosine")
            row = {"recall_target": wanted, "ran": plan["runs"], "plan": planned_plan.plan,
                   "nprobe": plan.get("nprobe"), "nlist": plan.get("nlist"),
                   "recall_estimate": plan.get("recall_estimate"), "recall": round(measured, 4),
                   "seconds": round(seconds, 2), "plan_seconds": round(plan_s, 2),
                   "speedup_vs_exact": round(exact_s / seconds, 2),
                   "cpu_seconds": round(cpu, 1), "cpu_vs_exact": round(exact_cpu / cpu, 2),
                   "load_1min": [before, load()], "runs": runs}
            if faiss_too and plan["runs"] == "ivf":   # (an exact fallback has recall 1: faiss would search every list)
                f_probe, f_recall, f_seconds = faiss_at_recall(targets, queries, exact, plan["nlist"],
                                                               50 * plan["nlist"], measured, metric)
                row.update(faiss_seconds=round(f_seconds, 2), faiss_nprobe=f_probe,
                           faiss_recall=round(f_recall, 4), ours_over_faiss=round(seconds / f_seconds, 2))
            rec.add(table, engine=engine, **row, **common)

    approx_rows("nearest_by_join approx", True, **forced)
    if kind == "minilm" and not blocked:
        # A nightly job's case: the index an earlier run saved (built here, untimed); each call
        # estimates recall and searches, without sampling and training.
        from nearest_join.ivf_index import build_ivf_index

        index = build_ivf_index(t, column="w", metric=metric, seed=0)
        approx_rows("nearest_by_join approx, saved index", False, index=index)
        # The IVF plan's floor: every fixed cost of the call, almost no search.
        approx_rows("nearest_by_join approx, saved index, nprobe 1 given (the plan's floor)", False,
                    wanteds=(None,), index=index, nprobe=1)
    t.unpersist(), q.unpersist()


def fresh_call(workdir: str, metric: str, driver_memory: str, options: dict, profile: str | None):
    """One call in a new Spark session, as a user's first call (run in a process of its own): the
    Parquet inputs of ``workdir`` read (not cached), planned, searched and the (qid, tid, value)
    rows collected; returns (figures, rows). The exact engine then saves an index (untimed) for
    the saved-index engines. ``profile``: a ``conf/`` profile whose Spark settings the session
    takes (its master and driver memory aside), as the batch jobs' sessions do."""
    conf = {}
    if profile:
        from jobs.spec import load_profile

        conf = {key: value for key, value in load_profile(profile)[1].items()
                if key not in ("master", "spark.master", "spark.driver.memory")}
    spark = local_spark("nearest_join-approx-fresh", driver_memory, conf=conf)
    q, t = (spark.read.parquet(os.path.join(workdir, f"{side}.parquet")) for side in ("q", "t"))
    save_index = not options   # the exact engine's call saves the index
    options = dict(options)
    if options.pop("through_spark", False):   # a filter that keeps every row: Spark reads the sides
        q, t = q.where("qid >= 0"), t.where("tid >= 0")
    if "index" in options:
        from nearest_join.ivf_index import IVFIndex

        options = {**options, "index": IVFIndex.load(options["index"])}
    start = time.perf_counter()
    planned = exact_or_approx(q, t, metric, **options)
    planning = time.perf_counter() - start
    pairs = pairs_of(planned.dataframe().select("qid", "tid", "value"))
    seconds = time.perf_counter() - start
    ivf = planned.plan.ivf or {}
    figures = {"seconds": round(seconds, 2), "plan_seconds": round(planning, 2), "ran": ivf.get("runs", "exact"),
               "nprobe": ivf.get("nprobe"), "nlist": ivf.get("nlist"), "recall_estimate": ivf.get("recall_estimate")}
    if save_index:
        from nearest_join.ivf_index import build_ivf_index

        build_ivf_index(t, column="w", metric=metric, seed=0).save(os.path.join(workdir, "index"))
    spark.stop()
    return figures, pairs


def fresh_sessions(rec: Recorder, kind: str, rows: int, recalls, workdir: str, driver_memory: str,
                   profile: str | None, repeat: int = 1) -> None:
    """Table ``fresh_<kind><rows>`` (``..._<profile>``: the sessions take that profile's
    settings): each engine's first call in a fresh session (its own process: a new JVM, new
    Python workers; the numba cache on disk as ``make run`` left it), inputs read from
    Parquet: exact, approx per recall target, and approx with the index an earlier run saved;
    each engine the fastest of ``repeat`` such calls."""
    import pyarrow.parquet as pq

    targets, queries = make_data(kind, rows, rows)
    metric = "cosine" if kind == "minilm" else METRIC
    for side, matrix, ids, vectors in (("q", queries, "qid", "v"), ("t", targets, "tid", "w")):
        pq.write_table(vector_table(np.arange(matrix.shape[0], dtype=np.int32), matrix, ids, vectors),
                       os.path.join(workdir, f"{side}.parquet"), row_group_size=50_000)
    common = {"data": kind, "nt": rows, "nq": rows, "d": targets.shape[1], "k": K, "metric": metric,
              "master": "local[2]"}
    engines = [("exact", None, {}), ("exact, sides read by Spark", None, {"through_spark": True})] + [
        (f"approx {r}", r, {"mode": "approx", "recall": r}) for r in recalls] + [
        (f"approx {r}, saved index", r, {"mode": "approx", "recall": r, "index": os.path.join(workdir, "index")})
        for r in recalls]
    exact = exact_s = None
    while engines:
        engine, wanted, options = engines.pop(0)
        calls = []
        for _ in range(repeat):
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh:
                calls.append(fresh.submit(fresh_call, workdir, metric, driver_memory, options, profile).result())
        figures, found = min(calls, key=lambda call: call[0]["seconds"])
        figures["runs"] = [call[0]["seconds"] for call in calls]
        if exact is None:
            exact, exact_s = found, figures["seconds"]
        rec.add(f"fresh_{kind}{rows}" + (f"_{profile}" if profile else ""), engine=f"nearest_by_join {engine}",
                recall_target=wanted, **figures,
                recall=round(recall_of(found, exact, rows, descending=metric == "cosine"), 4),
                speedup_vs_exact=round(exact_s / figures["seconds"], 2), **common)
        if engine == f"approx {recalls[-1]}, saved index":
            # What the estimate costs (its nprobe given), and the IVF plan's floor: every fixed
            # cost (the facts job, both sides' passes, routing, the output) and almost no search.
            saved = {"mode": "approx", "index": os.path.join(workdir, "index")}
            if figures["nprobe"] is not None:   # (None: that call ran the exact plan)
                engines.append((f"approx, saved index, nprobe {figures['nprobe']} given", None,
                                {**saved, "nprobe": figures["nprobe"]}))
            engines.append(("approx, saved index, nprobe 1 given (the plan's floor)", None, {**saved, "nprobe": 1}))


def recall_over_seeds(spark, rec: Recorder, kind: str, nt: int, nq: int, recalls, seeds: int,
                      workdir: str) -> None:
    """Table ``seeds_<data><nt>``: per recall target, ``seeds`` approx calls, each its own seed
    (training sample, k-means, the estimate's queries), their recall against the exact pairs;
    the sides cached (Spark's seeded samples), then read from their Parquet files (the
    samples drawn from the files)."""
    targets, queries, t, q, metric = cached_inputs(spark, kind, nt, nq, workdir)

    def pairs(q, t, **options):
        planned = exact_or_approx(q, t, metric, **options)
        return pairs_of(planned.dataframe().select("qid", "tid", "value")), planned.plan

    exact, _ = pairs(q, t)
    for sides, wanted in [(sides, wanted) for sides in ("cached", "files") for wanted in recalls]:
        if sides == "files" and t.is_cached:   # (a cache of the same plan would serve the files' reads)
            t.unpersist(blocking=True), q.unpersist(blocking=True)
            t, q = (spark.read.parquet(os.path.join(workdir, f"{kind}-{side}.parquet")) for side in ("t", "q"))
        calls = []
        for seed in range(seeds):
            found, plan = pairs(q, t, mode="approx", recall=wanted, seed=seed)
            ivf = plan.ivf
            calls.append({"seed": seed, "ran": ivf["runs"], "nprobe": ivf.get("nprobe"), "nlist": ivf.get("nlist"),
                          "estimate": ivf.get("recall_estimate"),
                          "lower": (ivf.get("recall_interval") or [None])[0],
                          "recall": round(recall_of(found, exact, nq, descending=metric == "cosine"), 4)})
        measured = sorted(c["recall"] for c in calls)
        lowers = [c["lower"] for c in calls if c["lower"] is not None]
        rec.add(f"seeds_{kind}{nt}", data=kind, nt=nt, nq=nq, d=targets.shape[1], k=K, metric=metric,
                master="local[2]", sides=sides, recall_target=wanted, seeds=seeds,
                met=sum(r >= wanted for r in measured), ran=sorted({c["ran"] for c in calls}),
                nprobe=sorted({c["nprobe"] for c in calls if c["nprobe"] is not None}),
                lowest_bound=round(min(lowers), 4) if lowers else None, recall_min=measured[0],
                recall_median=measured[len(measured) // 2], recall_max=measured[-1], calls=calls)


def index_ceiling(rec: Recorder, rows: int, recalls=(0.9, 0.95)) -> None:
    """Table ``ceiling_minilm<rows>``: the real embeddings' self-join, kernels alone, no Spark; per
    recall target the smallest nprobe (our IVF) or efSearch (faiss HNSW) whose *measured* recall
    reaches it (the table's text in report.py says more)."""
    import faiss

    from benchmarks.embeddings import load
    from nearest_join.ivf_index import default_nlist, default_sample_rows
    from nearest_kernels import knn
    from nearest_kernels.kmeans import kmeans, route
    from nearest_kernels.segments import knn_probed

    x = np.ascontiguousarray(load(rows))
    n = x.shape[0]
    common = {"data": "minilm", "rows": n, "d": x.shape[1], "k": K, "metric": "cosine", "threads": 2}
    start = time.perf_counter()
    values, ids = knn(x, x, K, "cosine", backend="cpu", threads=2)
    exact_s = time.perf_counter() - start
    exact = result_rows(values, ids)
    rec.add(f"ceiling_minilm{n}", index="exact (knn)", parameters="-", recall_target=None, recall=1.0,
            build_seconds=0.0, search_seconds=round(exact_s, 2), vs_exact=1.0, **common)

    def add(index, parameters, wanted, recall, build, search):
        rec.add(f"ceiling_minilm{n}", index=index, parameters=parameters, recall_target=wanted,
                recall=round(recall, 4), build_seconds=round(build, 2), search_seconds=round(search, 2),
                vs_exact=round(exact_s / (build + search), 2), search_vs_exact=round(exact_s / search, 2), **common)

    base = default_nlist(n, n)
    for nlist in (base, 2 * base, 3 * base):
        start = time.perf_counter()
        sample = x[np.sort(np.random.default_rng(0).choice(n, min(n, default_sample_rows(nlist, n)), replace=False))]
        centroids = kmeans(sample, nlist, "cosine", seed=0, threads=2).centroids
        lists = route(x, centroids, "cosine", 1, threads=2)[:, 0]
        order = np.argsort(lists, kind="stable")
        targets = np.ascontiguousarray(x[order])
        starts = np.concatenate([[0], np.cumsum(np.bincount(lists, minlength=nlist))]).astype(np.int64)
        build = time.perf_counter() - start
        pending, nprobe = list(recalls), 1
        while pending and nprobe <= nlist // 2:
            start = time.perf_counter()   # the search routes its queries to their lists
            probes = route(x, centroids, "cosine", nprobe, threads=2)
            v, i = knn_probed(x, targets, starts, np.arange(0, n * nprobe + 1, nprobe, dtype=np.int64),
                              probes.ravel(), K, "cosine", threads=2)
            search = time.perf_counter() - start
            recall = recall_of(result_rows(v, np.where(i >= 0, order[np.maximum(i, 0)], -1)), exact, n, descending=True)
            while pending and recall >= pending[0]:
                add("IVF (ours, knn_probed)", f"nlist {nlist}, nprobe {nprobe}", pending.pop(0), recall, build, search)
            nprobe += max(1, nprobe // 4)
    faiss.omp_set_num_threads(2)
    start = time.perf_counter()
    hnsw = faiss.IndexHNSWFlat(x.shape[1], 16, faiss.METRIC_INNER_PRODUCT)
    hnsw.add(x)
    build = time.perf_counter() - start
    pending = list(recalls)
    for ef in (16, 24, 32, 48, 64, 96, 128):
        hnsw.hnsw.efSearch = ef
        start = time.perf_counter()
        v, i = hnsw.search(x, K)
        search = time.perf_counter() - start
        recall = recall_of(result_rows(v, i), exact, n, descending=True)
        while pending and recall >= pending[0]:
            add("HNSW (faiss IndexHNSWFlat, M 16)", f"efSearch {ef}", pending.pop(0), recall, build, search)
        if not pending:
            break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="nt 50,000, nq 5,000 (smoke)")
    size.add_argument("--full", action="store_true", help="the issue's nt 1,000,000, nq 100,000")
    ap.add_argument("--datasets", nargs="+", default=["clustered", "gaussian"],
                    choices=["clustered", "gaussian", "minilm"])
    ap.add_argument("--seeds", type=int, default=0,
                    help="instead of the timings: recall honesty over this many seeds per target")
    ap.add_argument("--blocked", action="store_true",
                    help="every call with broadcast_limit_bytes=0: the target too large to broadcast")
    ap.add_argument("--ceiling", action="store_true", help="instead: the indexes' kernels alone on the real embeddings")
    ap.add_argument("--fresh", action="store_true", help="instead: each engine's first call in a fresh session")
    ap.add_argument("--profile", help="--fresh: the sessions take this conf/ profile's Spark settings (local)")
    ap.add_argument("--driver-memory", default="8g")
    ap.add_argument("--repeat", type=int, default=2,
                    help="calls per engine (under --fresh each in a fresh session), the fastest reported "
                         "(the Gaussian data's calls run once: its approx call runs the exact plan)")
    args = ap.parse_args()
    nt, nq = (50_000, 5_000) if args.quick else (1_000_000, 100_000) if args.full else (200_000, 20_000)
    rec = Recorder("approx", gpu=False, results_dir=SMOKE_DIR if args.quick else None)
    if args.ceiling:
        index_ceiling(rec, MINILM_ROWS)
        rec.print_tables()
        return
    spark = None if args.fresh else local_spark("nearest_join-approx-bench", args.driver_memory)
    with tempfile.TemporaryDirectory(prefix="nj-approx-") as workdir:
        for kind in args.datasets:
            size = (MINILM_ROWS, MINILM_ROWS) if kind == "minilm" else (nt, nq)
            if args.fresh:
                fresh_sessions(rec, kind, size[0], (0.9, 0.95), workdir, args.driver_memory, args.profile,
                               args.repeat)
            elif args.seeds:
                recall_over_seeds(spark, rec, kind, *size, (0.9, 0.95), args.seeds, workdir)
            elif kind == "minilm":
                run_dataset(spark, rec, kind, *size, (0.9, 0.95), workdir, repeat=args.repeat, blocked=args.blocked)
            else:
                run_dataset(spark, rec, kind, nt, nq, RECALLS if kind == "clustered" else (0.95,), workdir,
                            force=args.quick, repeat=args.repeat if kind == "clustered" else 1, blocked=args.blocked)
    if spark is not None:
        spark.stop()
    rec.print_tables()


if __name__ == "__main__":
    main()
