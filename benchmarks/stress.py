"""Random joins for a bounded time, each checked against the float64 difference-form oracle (table
``totals``; what it checks: its text in ``benchmarks/report.py``). Prints a line per join that went wrong
and the totals; a timed run records them, and ``--out FILE`` appends them as a JSON line.

Usage: ``python benchmarks/stress.py --minutes 30 [--out FILE]``, or ``--replay SEED ...``.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._record import Recorder, git_commit, local_spark, vector_table  # noqa: E402
from tests import oracle  # noqa: E402

METRICS = ("l2", "sqeuclidean", "cosine", "inner_product")
KINDS = ("gaussian", "offset", "magnitude", "parallel", "integer", "duplicates")
VALUE_RTOL = oracle.OPERATOR_VALUE_RTOL      # float32 rounding of a value, as a bound on keys (l2: squared)
MASTER = "local[2]"
CHECK_ROWS = 200             # queries of each exact join checked against the oracle
APPROX_SHARE = 0.5           # share of the joins that run mode="approx" (the seed decides which)
REFRESH_SHARE = 0.15         # share of the seeds that run a chain of incremental refreshes instead
APPROX_CHAINS = 0.5          # share of those chains in mode="approx"


def draw(seed: int) -> dict:
    """The inputs and options of one join."""
    rng = np.random.default_rng(seed)
    size = lambda: int(rng.choice([0, 1, 2, rng.integers(3, 60), rng.integers(60, 5001)],  # noqa: E731
                                  p=[0.04, 0.08, 0.04, 0.34, 0.5]))
    nq, nt = size(), size()
    d = int(rng.choice([1, 2, 3, int(rng.integers(4, 65)), int(rng.integers(65, 401))]))
    while nq * nt * d > 3e8:        # keep one join within seconds on two cores
        nq, nt = max(1, nq // 2), max(1, nt // 2)
    kind = str(rng.choice(KINDS))
    dtype = np.float64 if rng.random() < 0.3 else np.float32
    total = nq + nt
    if kind == "gaussian":
        data = rng.standard_normal((total, d)) * rng.uniform(0.1, 5)
    elif kind == "offset":
        offset = 10.0 ** rng.uniform(0, 4)
        data = offset + offset * 10.0 ** rng.uniform(-4, -1) * rng.standard_normal((total, d))
    elif kind == "magnitude":
        data = 10.0 ** rng.choice([-30, -24, -10, 10, 20, 30]) * rng.standard_normal((total, d))
        if dtype == np.float32:
            data = np.clip(data, -1e37, 1e37)
    elif kind == "parallel":
        base = rng.standard_normal(d)
        data = base * (1 + 0.01 * rng.random((total, 1))) + 1e-3 * rng.standard_normal((total, d))
    elif kind == "integer":
        data = rng.integers(0, 4, (total, d)).astype(np.float64)
    else:
        pool = rng.standard_normal((max(1, total // 5), d))
        data = pool[rng.integers(0, pool.shape[0], total)]
    data = data.astype(dtype)
    if kind in ("offset", "duplicates") and nq and nt:           # queries that copy targets
        copies = rng.random(nq) < 0.4
        data[:nq][copies] = data[nq:][rng.integers(0, nt, copies.sum())]
    Q, T = data[:nq], data[nq:]
    null_vec = lambda n: rng.random(n) < rng.choice([0, 0.05, 1.0], p=[0.6, 0.35, 0.05])  # noqa: E731
    q_null, t_null = null_vec(nq), null_vec(nt)
    for M in (Q, T):                                              # NULL elements (NaN here)
        if M.size and rng.random() < 0.3:
            M[rng.random(M.shape[0]) < 0.05, int(rng.integers(0, d))] = np.nan
    metric = str(rng.choice(METRICS))
    if metric == "cosine" and rng.random() < 0.3 and nq:          # zero vectors
        Q[rng.random(nq) < 0.1] = 0
    blocked = rng.random() < 0.4
    # small blocks, but at most ~20 x 20 block pairs (one Spark task each) per join
    options = dict(broadcast_limit_bytes=0,
                   query_block_rows=int(rng.integers(max(1, nq // 20), max(2, nq // 20) + 300)),
                   target_block_rows=int(rng.integers(max(1, nt // 20), max(2, nt // 20) + 600))) \
        if blocked else {}
    return dict(seed=seed, Q=Q, T=T, q_null=q_null, t_null=t_null, metric=metric,
                k=int(rng.integers(1, 101)), join_type=str(rng.choice(["inner", "leftouter"])),
                q_parts=int(rng.choice([1, 2, rng.integers(3, 40)])),
                t_parts=int(rng.choice([1, 2, rng.integers(3, 40)])), kind=kind, options=options)


def _rankable(M: np.ndarray, null: np.ndarray, metric: str) -> np.ndarray:
    ok = ~null & np.isfinite(M).all(axis=1)
    if metric == "cosine":
        ok &= (M != 0).any(axis=1)
    return ok


def _clean(M: np.ndarray) -> np.ndarray:
    """``M`` in float64 with its NULL elements (NaN) as 0: the oracle's input, the rows that
    hold them masked or refused by the caller."""
    return np.nan_to_num(M.astype(np.float64), nan=0.0)


def _value_tolerance(exact: float, scale: float, metric: str) -> float:
    """How far a returned value may lie from the oracle's ``exact`` one: float32 rounding of the
    value, and of the problem's size (``scale``, :func:`tests.oracle.key_scale` of its query)."""
    return VALUE_RTOL * abs(exact) + 1e-9 * (np.sqrt(scale) if metric == "l2" else 1.0 if metric == "cosine" else scale)


def _frame(spark, M: np.ndarray, null: np.ndarray, id_name: str, vector_name: str, parts: int, keys=None,
           ids=None):
    """A DataFrame (id, vector array<float|double>[, key int]) in ``parts`` partitions: NULL
    vectors where ``null``, NULL elements where ``M`` holds NaN, NULL keys where ``keys < 0``;
    the ids ``ids`` (default: the row positions, as int)."""
    import pyarrow as pa

    ids = np.arange(M.shape[0], dtype=np.int32) if ids is None else ids
    table = vector_table(ids, M, id_name, vector_name, null)
    if keys is not None:
        table = table.append_column("key", pa.array(keys, mask=keys < 0, type=pa.int32()))
    return spark.createDataFrame(table).repartition(parts)


def _by_query(out, nq: int, problems: list) -> dict[int, list]:
    """A join's rows as {query id: [(value, target id)]}; a query id not in 0..nq-1 is a problem."""
    per_query = oracle.group_rows(out, lambda r: r["qid"], lambda r: r["tid"], lambda r: r["d"])
    if set(per_query) - set(range(nq)):
        problems.append(f"unknown query ids {sorted(set(per_query) - set(range(nq)))[:5]}")
    return per_query


def run_join(spark, case: dict) -> tuple[int, list[str]]:
    """Run one join; (rows checked, problems)."""
    from nearest_join import nearest_by_join

    Q, T, metric, k = case["Q"], case["T"], case["metric"], case["k"]
    q = _frame(spark, Q, case["q_null"], "qid", "qv", case["q_parts"])
    t = _frame(spark, T, case["t_null"], "tid", "tv", case["t_parts"])
    out = nearest_by_join(q, t, metric, k, vectors=("qv", "tv"), join_type=case["join_type"],
                          distance_col="d", **case["options"]).collect()
    problems = []
    q_ok = _rankable(Q, case["q_null"], metric)
    t_ok = np.flatnonzero(_rankable(T, case["t_null"], metric))
    per_query = _by_query(out, Q.shape[0], problems)
    expected_count = min(k, t_ok.size)
    for i in range(Q.shape[0]):
        found = per_query.get(i, [])
        if q_ok[i] and expected_count:
            if len(found) != expected_count or any(tid is None for _, tid in found):
                problems.append(f"query {i}: {len(found)} rows, expected {expected_count}")
        elif case["join_type"] == "leftouter":
            if len(found) != 1 or found[0][1] is not None or found[0][0] is not None:
                problems.append(f"query {i} (no candidate): {found}, expected one NULL row")
        elif found:
            problems.append(f"query {i} (no candidate): {len(found)} rows, expected none")
    checked = np.flatnonzero(q_ok)
    if expected_count and checked.size and not problems:
        rng = np.random.default_rng(case["seed"])
        checked = np.sort(rng.choice(checked, min(CHECK_ROWS, checked.size), replace=False))
        Tc = T[t_ok]
        keys = np.sort(oracle.oracle_keys(Q[checked], Tc, metric), axis=1)
        # Values that leave float32's normal range (inf, or a subnormal/0 for a nonzero key)
        # tie in the merge of target blocks: such rows are not rank-checked.
        kth_value = np.abs(oracle.key_values(keys[:, expected_count - 1], metric))
        best_value = np.abs(oracle.key_values(keys[:, 0], metric))
        fits = (kth_value < 3e38) & ((best_value > 1.2e-38) | (keys[:, 0] == 0))
        fits &= (np.abs(oracle.key_values(keys, metric)) < 3e38).all(axis=1) | (metric == "l2")
        checked, keys = checked[fits], keys[fits, expected_count - 1]
        Qc = Q[checked]
        scale = oracle.key_scale(Qc, Tc, metric)
        rounding = VALUE_RTOL * (np.maximum(np.abs(keys), 2.0) if metric == "cosine" else np.abs(keys))
        # (scale 0: every target the same point, no ranking to round; the values keep their
        # own float32 tolerance in the oracle)
        rtol = float(np.max(np.divide(rounding, scale, out=np.zeros_like(rounding), where=scale > 0),
                            initial=0.0)) + 1e-12
        if checked.size:
            values, indices = oracle.join_arrays({int(i): per_query[int(i)] for i in checked}, k, metric,
                                                 checked.tolist(), t_ok.tolist())
            try:
                oracle.assert_true_topk(Qc, Tc, k, metric, values.astype(np.float32), indices, rtol,
                                        case=f"seed {case['seed']}")
            except AssertionError as exc:
                problems.append(str(exc)[:2000])
    return int(checked.size), problems


APPROX_KINDS = ("clustered", "gaussian", "duplicates", "offset")


def draw_approx(seed: int) -> dict:
    """The inputs and options of one ``mode="approx"`` join."""
    rng = np.random.default_rng([seed, 1])
    nt = int(rng.integers(300, 6001))
    nq = int(rng.choice([1, int(rng.integers(2, 60)), int(rng.integers(60, 1201))], p=[0.05, 0.25, 0.7]))
    d = int(rng.choice([1, 2, int(rng.integers(3, 33)), int(rng.integers(33, 129)), 384],
                       p=[0.05, 0.05, 0.4, 0.35, 0.15]))
    while nq * nt * d > 1.5e8:
        nq, nt = max(1, nq // 2), max(300, nt // 2) if nt > 300 else nt
        if nq == 1 and nt == 300:
            break
    kind = str(rng.choice(APPROX_KINDS))
    total = nq + nt
    clusters = int(rng.integers(2, 200))
    centres = rng.standard_normal((clusters, d)) * rng.uniform(0.5, 10)
    data = centres[rng.integers(0, clusters, total)] + rng.standard_normal((total, d))
    if kind == "gaussian":
        data = rng.standard_normal((total, d))
    elif kind == "duplicates":                                   # groups of identical rows
        copies = rng.random(total) < 0.3
        data[copies] = data[rng.integers(0, total, copies.sum())]
    elif kind == "offset":
        data += 1e3
    dtype = np.float64 if rng.random() < 0.2 else np.float32
    data = data.astype(dtype)
    Q, T = data[:nq], data[nq:]
    metric = str(rng.choice(METRICS))
    null = lambda n: rng.random(n) < rng.choice([0, 0.03])       # noqa: E731
    q_null, t_null = null(nq), null(nt)
    options: dict = {"mode": "approx", "seed": int(rng.integers(0, 1000))}
    estimated = rng.random() < 0.8
    if estimated:
        options["recall"] = float(rng.choice([0.5, 0.8, 0.9, 0.95, 0.99]))
    keys = None
    if rng.random() < 0.3:                                       # skewed key groups, NULL keys
        groups = int(rng.integers(1, 12))
        weights = 1.0 / np.arange(1, groups + 1) ** 1.5
        draw_keys = lambda n: np.where(rng.random(n) < 0.03, -1,  # noqa: E731
                                       rng.choice(groups, n, p=weights / weights.sum()))
        keys = (draw_keys(nq), draw_keys(nt))
        options["on"] = "key"
    cap_quantile = float(rng.uniform(0.2, 0.9)) if rng.random() < 0.25 else None
    if rng.random() < 0.25:
        options.update(broadcast_limit_bytes=0, query_block_rows=int(rng.integers(max(1, nq // 8), nq // 4 + 200)),
                       target_block_rows=int(rng.integers(max(1, nt // 8), nt // 4 + 400)))
    old_target = None
    nlist = int(rng.integers(1, max(2, int(2 * np.sqrt(nt))) + 1))
    if rng.random() < 0.25:
        # An index trained on yesterday's target: a fifth of its rows since replaced by new
        # draws, a twentieth moved, a tenth deleted (today's T has them no more).
        old_target = T.copy()
        moved = rng.random(nt) < 0.2
        old_target[moved] = centres[rng.integers(0, clusters, moved.sum())] + rng.standard_normal((moved.sum(), d))
        shifted = rng.random(nt) < 0.05
        old_target[shifted] += rng.standard_normal((shifted.sum(), d)).astype(dtype)
        old_target = np.concatenate([old_target, rng.standard_normal((nt // 10, d)).astype(dtype)])
    else:
        options["nlist"] = nlist
    if not estimated:
        options["nprobe"] = int(rng.choice([1, int(rng.integers(1, nlist + 1)), nlist]))
    return dict(seed=seed, Q=Q, T=T, q_null=q_null, t_null=t_null, metric=metric, kind=kind,
                k=int(rng.choice([1, int(rng.integers(2, 11)), int(rng.integers(11, 51))])),
                join_type=str(rng.choice(["inner", "leftouter"])), keys=keys, cap_quantile=cap_quantile,
                q_parts=int(rng.choice([1, 2, rng.integers(3, 20)])),
                t_parts=int(rng.choice([1, 2, rng.integers(3, 20)])), options=options, old_target=old_target,
                nlist=nlist)


def _candidates(case: dict, all_keys: np.ndarray) -> np.ndarray:
    """(nq, nt) bool: the targets each query may be given (rankable, same key, within the cap)."""
    Q, T, metric = case["Q"], case["T"], case["metric"]
    ok = _rankable(Q, case["q_null"], metric)[:, None] & _rankable(T, case["t_null"], metric)[None, :]
    if case["keys"] is not None:
        q_keys, t_keys = case["keys"]
        ok &= (q_keys[:, None] == t_keys[None, :]) & (q_keys[:, None] >= 0)
    if case["cap"] is not None:
        values = oracle.key_values(all_keys, metric)
        ok &= values >= case["cap"] if metric in ("cosine", "inner_product") else values <= case["cap"]
    return ok


def run_approx_join(spark, case: dict, workdir: Path) -> dict:
    """Run one approx join: its problems (wrong rows), its recall@k, what its plan promised."""
    from nearest_join.ivf_index import IVFIndex
    from nearest_join.join import plan_join
    from nearest_join.options import JoinOptions

    Q, T, metric, k = case["Q"], case["T"], case["metric"], case["k"]
    all_keys = oracle.oracle_keys(_clean(Q), _clean(T), metric)   # (NULLs are masked below)
    values = oracle.key_values(all_keys, metric)
    case["cap"] = None
    if case["cap_quantile"] is not None and Q.shape[0]:
        kth_values = oracle.key_values(np.sort(all_keys, axis=1)[:, min(k, T.shape[0]) - 1], metric)
        finite = kth_values[np.isfinite(kth_values)]
        if finite.size:
            # Midway between two of the join's values, as the tests' caps lie: a cap on a
            # value would compare two roundings of one sum (the oracle's summation order
            # against the kernels'), which differ in the last bits.
            # (No other value: no cap; a cap beyond every value may be out of the metric's range.)
            quantile = float(np.quantile(finite, case["cap_quantile"]))
            every = np.unique(values[np.isfinite(all_keys)])
            above = every[np.searchsorted(every, quantile, side="right"):][:1]
            below = every[:np.searchsorted(every, quantile, side="left")][-1:]
            near = above if above.size else below
            case["cap"] = (quantile + float(near[0])) / 2 if near.size else None
    options = dict(case["options"])
    if case["cap"] is not None:
        options["min_similarity" if metric in ("cosine", "inner_product") else "max_distance"] = case["cap"]
    if case["old_target"] is not None:
        old = case["old_target"]
        rankable = old[_rankable(old, np.zeros(old.shape[0], bool), metric)]
        index = IVFIndex.train(rankable, metric, min(case["nlist"], rankable.shape[0]), seed=options["seed"])
        path = workdir / f"index-{case['seed']}"
        index.save(path)
        options["index"] = IVFIndex.load(path)
        if options.get("nprobe", 0) > options["index"].nlist:
            options["nprobe"] = options["index"].nlist
    q_keys, t_keys = case["keys"] or (None, None)
    q = _frame(spark, Q, case["q_null"], "qid", "qv", case["q_parts"], q_keys)
    t = _frame(spark, T, case["t_null"], "tid", "tv", case["t_parts"], t_keys)
    join_options = JoinOptions(num_results=k, vectors=("qv", "tv"), join_type=case["join_type"],
                               distance_col="d", **options)
    planned = plan_join(q, t, metric, join_options)
    ivf = planned.plan.ivf or {}
    out = planned.dataframe().collect()

    candidates = _candidates(case, all_keys)
    scale = oracle.key_scale(_clean(Q), _clean(T), metric)
    promised_exact = ivf.get("runs") == "exact" or "the exact result" in ivf.get("explanation", "")
    problems, recalls, wanted = [], [], 0
    per_query = _by_query(out, Q.shape[0], problems)
    for i in range(Q.shape[0]):
        allowed = np.flatnonzero(candidates[i])
        width = min(k, allowed.size)
        found = per_query.get(i, [])
        if not [tid for _, tid in found if tid is not None]:
            if case["join_type"] == "leftouter" and (len(found) != 1 or found[0] != (None, None)):
                problems.append(f"query {i}: {found}, expected one NULL row")
            if case["join_type"] == "inner" and found:
                problems.append(f"query {i}: {found}, expected no row")
            found = []
        tids = [tid for _, tid in found]
        if len(set(tids)) != len(tids) or len(tids) > width:
            problems.append(f"query {i}: targets {tids}, at most {width} distinct expected")
            continue
        wrong = [tid for tid in tids if tid is None or not candidates[i, tid]]
        if wrong:
            problems.append(f"query {i}: targets {wrong} are not its candidates (key, cap, rankable)")
            continue
        for value, tid in found:
            exact = values[i, tid]
            if not abs(value - exact) <= _value_tolerance(exact, scale[i], metric):
                problems.append(f"query {i} target {tid}: value {value}, exact {exact}")
        if width == 0:
            continue
        kth = np.sort(all_keys[i, allowed])[width - 1]
        # Rows whose values round to the same float32 tie (blocks merge on float32 values):
        # as run_join's tolerance, relative to the value (a cosine's near 1, its key near 0).
        near = kth + VALUE_RTOL * (max(abs(kth), 2.0) if metric == "cosine" else abs(kth)) + 1e-12 * scale[i]
        got = min(width, int((all_keys[i, tids] <= near).sum()))
        recalls.append(got / width)
        wanted += width
        if promised_exact and got < width:
            problems.append(f"query {i}: {got} of its true top {width} where the plan promises the exact result")
    # recall@k as the plan estimates it (nearest_join.recall): the mean of the queries' own
    # recalls, queries with no true neighbour (a cap, a key without targets) left out; under a
    # cap a query's true top k may be fewer than k, so a share of all pairs would weigh the
    # queries with the most neighbours within the cap more.
    recall = float(np.mean(recalls)) if recalls else 1.0
    target = case["options"].get("recall") if ivf.get("recall_estimate") is not None else None
    if ivf.get("runs") == "ivf" and target is not None and recall < target:
        problems.append(f"recall@{k} {recall:.4f} < target {target} (estimate {ivf.get('recall_estimate')})")
    return dict(problems=problems, recall=recall, target=target, promised_exact=promised_exact,
                runs=ivf.get("runs"), nprobe=ivf.get("nprobe"), nlist=ivf.get("nlist"), rows=wanted)


def draw_refresh(seed: int) -> dict:
    """A chain of days for ``incremental_nearest_join``: day 0 the inputs of :func:`draw` (its
    adversarial data, NULL vectors and elements), on ids; each later day deletes, updates (the
    vector, its NULLness or, with ``on=`` keys, the key) and inserts a share of each side's
    rows, new vectors drawn from the day-0 data."""
    case = draw(seed)
    rng = np.random.default_rng([seed, 3])
    Q, T = case["Q"], case["T"]
    case.update(k=int(rng.choice([1, int(rng.integers(2, 11)), int(rng.integers(11, 31))])),
                margin=int(rng.choice([0, 1, int(rng.integers(2, 20))])), days=int(rng.integers(2, 5)),
                shares=[float(rng.choice([0.01, 0.1, 0.3, 0.6])) for _ in range(4)], keys=None, cap=None)
    if rng.random() < 0.3:
        groups = int(rng.integers(1, 6))
        case["keys"] = (rng.integers(-1, groups, Q.shape[0]), rng.integers(-1, groups, T.shape[0]), groups)
    if rng.random() < APPROX_CHAINS and case["kind"] != "magnitude":
        # mode="approx": the full run's IVF lists (nlist given: IVF runs at any size), the
        # refreshes' recall measured and the index re-trained below the target. (Not on
        # magnitudes beyond float32's range: a pair's value is checked against the oracle's.)
        nt = max(1, int(_rankable(T, case["t_null"], case["metric"]).sum()))
        nlist = int(min(nt, rng.integers(1, max(2, int(2 * np.sqrt(nt))) + 1)))
        case["approx"] = {"mode": "approx", "recall": float(rng.choice([0.5, 0.8, 0.9, 0.95])), "nlist": nlist,
                          "seed": int(rng.integers(0, 1000))}
        if rng.random() < 1 / 3:
            # nprobe given: the lists always IVF's (no estimate to choose exact), no recall
            # promised (the refreshes measure it, and never re-train for it)
            del case["approx"]["recall"]
            case["approx"]["nprobe"] = int(rng.integers(1, nlist + 1))
    # Half of the chains read each day's sides from Parquet files (Spark's, a file per
    # partition), as a nightly job does: a refresh in the driver reads their vectors from them.
    # Its own stream: the draws above stay those of earlier runs.
    case["parquet"] = bool(np.random.default_rng([seed, 6]).random() < 0.5)
    if rng.random() < 0.3 and Q.shape[0] and T.shape[0]:
        # a cap at a quantile of some of the pairs' values
        a, b = np.nan_to_num(Q[rng.integers(0, Q.shape[0], 50)].astype(np.float64)), \
            np.nan_to_num(T[rng.integers(0, T.shape[0], 50)].astype(np.float64))
        values = oracle.key_values(oracle.oracle_keys(a, b, case["metric"]), case["metric"]).ravel()
        values = values[np.isfinite(values)]
        if values.size:
            case["cap"] = float(np.quantile(values, rng.uniform(0.2, 0.8)))
    return case


def run_refresh(spark, case: dict, workdir: Path) -> tuple[int, list[str]]:
    """Each day of ``case``'s chain refreshed from the last day's committed state, against
    ``nearest_by_join`` of that day's inputs (the full recompute): the same queries, the same
    values per query, the same targets but for ties at the k-th value. (days run, problems)"""
    from nearest_join import nearest_by_join
    from nearest_join.errors import ArgumentError
    from nearest_join.incremental import incremental_nearest_join

    rng = np.random.default_rng([case["seed"], 4])
    metric, k = case["metric"], case["k"]
    pool = np.concatenate([case["Q"], case["T"]])
    sides = []
    for side, (M, null) in enumerate(((case["Q"], case["q_null"]), (case["T"], case["t_null"]))):
        keys = None if case["keys"] is None else case["keys"][side]
        sides.append([np.arange(M.shape[0]) + side * 10**6, M.copy(), null.copy(), keys])
    options = dict(vectors=("qv", "tv"), join_type=case["join_type"], distance_col="d")
    if case["keys"] is not None:
        options["on"] = "key"
    if case["cap"] is not None:
        options["min_similarity" if metric in ("cosine", "inner_product") else "max_distance"] = case["cap"]
    state, next_id, problems = workdir / f"state-{case['seed']}", 2 * 10**6, []
    sign = -1 if metric in ("cosine", "inner_product") else 1

    def grouped(rows):   # {query: [(key, target)]}, ascending keys
        out: dict = {}
        for r in rows:
            out.setdefault(r["qid"], []).append((None if r["d"] is None else sign * r["d"], r["tid"]))
        return {q_id: sorted(v, key=lambda x: (x[0] is None, x[0] or 0.0, x[1] or 0)) for q_id, v in out.items()}

    ran, approx_days = 0, []
    def day_frame(day, ids, M, null, keys, id_name, vector_name, parts):
        frame = _frame(spark, M, null, id_name, vector_name, parts, keys, ids=ids.astype(np.int64))
        if not case["parquet"]:
            return frame.cache()
        path = str(workdir / f"day-{case['seed']}-{day}-{id_name}")
        frame.write.parquet(path)
        return spark.read.parquet(path)

    for day in range(case["days"]):
        q, t = (day_frame(day, *side, id_name, vector_name, parts)
                for side, id_name, vector_name, parts
                in zip(sides, ("qid", "tid"), ("qv", "tv"), (case["q_parts"], case["t_parts"])))
        try:
            run = incremental_nearest_join(q, t, metric, k, query_id="qid", target_id="tid", state=str(state),
                                           margin=case["margin"], **options, **case.get("approx", {}))
        except ArgumentError as exc:
            # An approx chain's target shrank below its nlist and a run trained anew: refused,
            # as nearest_by_join refuses it (its message names nlist and the rows).
            if exc.argument != "nlist" or case["approx"]["nlist"] <= _rankable(*sides[1][1:3], metric).sum():
                raise
            q.unpersist(), t.unpersist()
            break
        got = [r.asDict() for r in run.dataframe(query_columns=(0,), target_columns=(0,)).collect()]
        full = [r.asDict() for r in nearest_by_join(q, t, metric, k, **options).collect()]
        run.commit()
        ran += 1
        q.unpersist(), t.unpersist()
        mine_all, theirs_all = grouped(got), grouped(full)
        if run.changes.recall is not None:   # IVF lists: approximate, checked as such
            approx_days.append(_approx_day(day, mine_all, theirs_all, sides, case, problems))
        else:
            if mine_all.keys() != theirs_all.keys():
                problems.append(f"day {day}: queries {sorted(mine_all.keys() ^ theirs_all.keys())[:5]} "
                                "in one result only")
            for q_id in sorted(mine_all.keys() & theirs_all.keys()):
                mine, theirs = mine_all[q_id], theirs_all[q_id]
                last = theirs[-1][0]
                if [v for v, _ in mine] != [v for v, _ in theirs] or \
                        {i for v, i in mine if v != last} != {i for v, i in theirs if v != last}:
                    problems.append(f"day {day} (refreshed {run.changes.refreshed}) query {q_id}: {mine[:6]} "
                                    f"against the full recompute's {theirs[:6]}")
                    break
        if problems:
            break
        share = case["shares"][day]
        for side in sides:                       # tomorrow: deletes, updates, inserts
            ids, M, null, keys = side
            n = ids.size
            keep = rng.random(n) >= share / 3
            ids, M, null = ids[keep], M[keep], null[keep]
            keys = None if keys is None else keys[keep]
            for j in np.flatnonzero(rng.random(ids.size) < share / 3):
                what = rng.random()
                if what < 0.6 and pool.shape[0]:
                    M[j] = pool[rng.integers(0, pool.shape[0])]
                elif what < 0.8 and keys is not None:
                    keys[j] = rng.integers(-1, case["keys"][2])
                else:
                    null[j] = not null[j]
            m = int(rng.binomial(max(n, 1), share / 3)) if pool.shape[0] else 0
            ids = np.concatenate([ids, next_id + np.arange(m)])
            next_id += m
            M = np.concatenate([M, pool[rng.integers(0, pool.shape[0], m)] if m else M[:0]])
            null = np.concatenate([null, rng.random(m) < 0.05])
            if keys is not None:
                keys = np.concatenate([keys, rng.integers(-1, case["keys"][2], m)])
            side[:] = [ids, M, null, keys]
    shutil.rmtree(state, ignore_errors=True)
    case["approx_days"] = approx_days
    return ran, problems


def _approx_day(day: int, mine_all: dict, theirs_all: dict, sides: list, case: dict, problems: list) -> float:
    """One day of an approx chain (lists of an IVF index): every row of the refreshed result
    a candidate of its query (rankable, its key, within the cap) with its exact value (the
    float64 oracle's, to float32 rounding), at most k distinct targets per query, only queries
    the exact recompute has; and recall@k against the exact recompute (``theirs_all``; a row
    as near as its k-th is a hit) at least the recall target, where the chain has one (not
    with nprobe given). Problems go to ``problems``; returns the day's recall."""
    metric, k, sign = case["metric"], case["k"], (-1 if case["metric"] in ("cosine", "inner_product") else 1)
    (q_ids, Q, q_null, q_keys), (t_ids, T, t_null, t_keys) = sides
    t_ok = _rankable(T, t_null, metric)
    scale = oracle.key_scale(_clean(Q), _clean(T[t_ok] if t_ok.any() else T[:1]), metric)
    recalls = []
    for q_id in sorted(mine_all.keys() - theirs_all.keys())[:1]:
        problems.append(f"day {day}: query {q_id} has rows where the exact recompute has none: {mine_all[q_id][:4]}")
    for q_id, theirs in theirs_all.items():
        mine = [(key, tid) for key, tid in mine_all.get(q_id, []) if tid is not None]
        theirs = [(key, tid) for key, tid in theirs if tid is not None]
        tids = [tid for _, tid in mine]
        if len(set(tids)) != len(tids) or len(tids) > k:
            problems.append(f"day {day} query {q_id}: targets {tids}, at most {k} distinct expected")
            continue
        i = int(np.searchsorted(q_ids, q_id))
        rows = np.searchsorted(t_ids, np.asarray(tids, dtype=np.int64))
        bad = [tid for tid, j in zip(tids, rows) if j >= t_ids.size or t_ids[j] != tid or not t_ok[j]
               or (q_keys is not None and (q_keys[i] < 0 or q_keys[i] != t_keys[j]))]
        if bad:
            problems.append(f"day {day} query {q_id}: targets {bad} are not its candidates (rankable, key)")
            continue
        if mine:
            exact = oracle.key_values(oracle.oracle_keys(_clean(Q[i:i + 1]), _clean(T[rows]), metric)[0], metric)
            for (key, tid), value in zip(mine, exact):
                if not abs(sign * key - value) <= _value_tolerance(value, scale[i], metric):
                    problems.append(f"day {day} query {q_id} target {tid}: value {sign * key}, exact {value}")
            if case["cap"] is not None and any(
                    key > sign * case["cap"] + _value_tolerance(case["cap"], scale[i], metric) for key, _ in mine):
                problems.append(f"day {day} query {q_id}: a row beyond the cap {case['cap']}: {mine[:4]}")
        if mine and not theirs:
            problems.append(f"day {day} query {q_id}: rows {mine[:4]} where the exact recompute has none")
        if theirs:
            kth = theirs[min(k, len(theirs)) - 1][0]
            near = kth + VALUE_RTOL * (max(abs(kth), 2.0) if metric == "cosine" else abs(kth)) + 1e-12
            recalls.append(min(len(theirs), sum(key <= near for key, _ in mine)) / len(theirs))
    recall = float(np.mean(recalls)) if recalls else 1.0
    target = case["approx"].get("recall")   # (None: nprobe given, no recall promised)
    if target is not None and recall < target:
        problems.append(f"day {day}: recall@{k} {recall:.4f} < target {target}")
    return recall


def describe(case: dict) -> str:
    """One join's inputs and options, for a line that reports it (``--replay`` its seed)."""
    approx = "old_target" in case
    if "days" in case:
        return (f"seed={case['seed']} refresh kind={case['kind']} nq={case['Q'].shape[0]} nt={case['T'].shape[0]} "
                f"d={case['Q'].shape[1]} dtype={case['Q'].dtype} k={case['k']} margin={case['margin']} "
                f"metric={case['metric']} join={case['join_type']} keys={case['keys'] is not None} "
                f"cap={case['cap']} parquet={case['parquet']} days={case['days']} "
                f"shares={case['shares'][:case['days'] - 1]}"
                f"{' approx=' + str(case['approx']) if 'approx' in case else ''}")
    options = {key: value for key, value in case["options"].items() if key != "index"}
    extra = (f"keys={case['keys'] is not None} cap={case.get('cap')} saved_index={case['old_target'] is not None}"
             if approx else f"parts={case['q_parts']}/{case['t_parts']}")
    return (f"seed={case['seed']}{' approx' if approx else ''} kind={case['kind']} nq={case['Q'].shape[0]} "
            f"nt={case['T'].shape[0]} d={case['Q'].shape[1]} dtype={case['Q'].dtype} k={case['k']} "
            f"metric={case['metric']} join={case['join_type']} {extra} options={options}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000 * 1000)
    parser.add_argument("--replay", type=int, nargs="+", help="run only the joins of these seeds")
    parser.add_argument("--out", type=Path, help="also append the totals to this file as a JSON line")
    args = parser.parse_args()

    spark = local_spark("nearest_join-stress", "3g", MASTER, {"spark.task.maxFailures": "1"})
    start = time.monotonic()
    joins = rows_checked = 0
    mismatches, crashes, approx_joins, refreshes = [], [], [], []
    workdir = Path(tempfile.mkdtemp(prefix="nearest_join-stress-"))
    for seed in args.replay or itertools.count(args.seed):
        if args.replay is None and time.monotonic() - start > args.minutes * 60:
            break
        is_refresh = np.random.default_rng([seed, 5]).random() < REFRESH_SHARE
        is_approx = not is_refresh and np.random.default_rng([seed, 2]).random() < APPROX_SHARE
        case = draw_refresh(seed) if is_refresh else draw_approx(seed) if is_approx else draw(seed)
        try:
            if is_refresh:
                days, problems = run_refresh(spark, case, workdir)
                checked = 0
                refreshes.append((case, days))
            elif is_approx:
                result = run_approx_join(spark, case, workdir)
                checked, problems = result["rows"], result["problems"]
            else:
                checked, problems = run_join(spark, case)
        except Exception as exc:  # noqa: BLE001 (a crash is a finding: record it, go on)
            crashes.append(seed)
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            print(f"CRASH {describe(case)}\n  {last[:1500]}", flush=True)
            continue
        joins += 1
        rows_checked += checked
        if is_approx:
            approx_joins.append((case, result))
        if problems:
            mismatches.append(seed)
            print(f"MISMATCH {describe(case)}\n  " + "\n  ".join(problems[:5]), flush=True)
        if joins % 25 == 0:
            print(f"... {joins} joins, {rows_checked} rows checked, {len(mismatches)} mismatches, "
                  f"{len(crashes)} crashes, {time.monotonic() - start:.0f} s", flush=True)
    elapsed = time.monotonic() - start
    # the recall targets an IVF plan chose nprobe for (not those it promised to meet exactly)
    margins = [round(r["recall"] - r["target"], 4) for _, r in approx_joins
               if r["target"] is not None and r["runs"] == "ivf" and not r["promised_exact"]]
    approx = {"joins": len(approx_joins), "ivf": sum(r["runs"] == "ivf" for _, r in approx_joins),
              "exact_promised": sum(r["promised_exact"] for _, r in approx_joins),
              "saved_index": sum(c["old_target"] is not None for c, _ in approx_joins),
              "keyed": sum(c["keys"] is not None for c, _ in approx_joins),
              "capped": sum(c["cap"] is not None for c, _ in approx_joins),
              "recall_targets": len(margins), "lowest_recall_margin": min(margins, default=None)}
    # approx chains: the days whose lists were IVF's, and their recall less the target
    ivf_days = [(c["approx"].get("recall"), r) for c, _ in refreshes for r in c.get("approx_days", [])]
    refresh = {"chains": len(refreshes), "days": sum(days for _, days in refreshes),
               "keyed": sum(c["keys"] is not None for c, _ in refreshes),
               "capped": sum(c["cap"] is not None for c, _ in refreshes),
               "parquet": sum(c["parquet"] for c, _ in refreshes),
               "approx": sum("approx" in c for c, _ in refreshes), "approx_ivf_days": len(ivf_days),
               "lowest_recall_margin": min((round(r - target, 4) for target, r in ivf_days if target is not None),
                                           default=None)}
    totals = dict(master=MASTER, first_seed=args.seed if args.replay is None else args.replay[0],
                  minutes=round(elapsed / 60, 1), joins=joins, rows_checked=rows_checked,
                  mismatches=mismatches, crashes=crashes)
    summary = dict(date=datetime.date.today().isoformat(), commit=git_commit(), **totals, approx=approx,
                   refresh=refresh, openblas_coretype=os.environ.get("OPENBLAS_CORETYPE", "unset"))
    print(json.dumps(summary))
    if args.replay is None:
        Recorder("stress", gpu=False).add("totals", **totals, check_rows=CHECK_ROWS, approx_share=APPROX_SHARE,
                                          refresh_share=REFRESH_SHARE,
                                          **{f"approx_{key}": value for key, value in approx.items()},
                                          **{f"refresh_{key}": value for key, value in refresh.items()})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(json.dumps(summary) + "\n")
    spark.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    return 1 if mismatches or crashes else 0


if __name__ == "__main__":
    sys.exit(main())
