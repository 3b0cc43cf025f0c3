"""Random joins for a bounded time, each checked against the float64 difference-form oracle.

Every join draws its own inputs from its seed: sizes 0-5,000 per side, d 1-400, k 1-100, all
metrics, inner and left outer, NULL vectors and NULL elements, zero vectors, duplicates, many
tiny input partitions, float and double elements, forced blocked plans with small blocks, and
the adversarial data of ``tests/adversarial.py`` (offsets much larger than the spread, extreme
magnitudes, nearly parallel vectors, integer ties). The output is checked row by row: which
queries appear and how often (INNER drops a query without candidates, LEFT OUTER keeps it once
with NULL target columns), and, for up to ``--check-rows`` queries of each join, that every
returned target is a true top-k row (``tests.adversarial.assert_true_topk``, with float32
value rounding as the tie tolerance, as in tests/join/test_exactness.py).

It prints one line per join that went wrong (with its seed: ``--replay SEED`` runs that one
again) and the totals; a timed run (not ``--replay``) records them in
``benchmarks/results/stress.jsonl`` (table ``totals``) for ``make bench-report``, and ``--out FILE``
also appends them as a JSON line.

Usage::

    python benchmarks/stress.py --minutes 30 --out benchmarks/out/stress.jsonl
    python benchmarks/stress.py --replay 1234
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from benchmarks._record import Recorder  # noqa: E402
from tests import adversarial  # noqa: E402

METRICS = ("l2", "sqeuclidean", "cosine", "inner_product")
KINDS = ("gaussian", "offset", "magnitude", "parallel", "integer", "duplicates")
VALUE_RTOL = 2.0 ** -21      # float32 rounding of a value, as a bound on keys (l2: squared)


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


def _arrow_side(M: np.ndarray, null: np.ndarray, id_name: str, vector_name: str):
    """An Arrow table (id int, vector array<float|double>): NULL vectors where ``null``,
    NULL elements where ``M`` holds NaN."""
    import pyarrow as pa

    flat = M.reshape(-1)
    values = pa.array(flat, mask=np.isnan(flat))
    offsets = pa.array(np.arange(M.shape[0] + 1, dtype=np.int32) * M.shape[1], pa.int32())
    vectors = pa.ListArray.from_arrays(offsets, values, mask=pa.array(null))
    return pa.table({id_name: pa.array(np.arange(M.shape[0], dtype=np.int32)), vector_name: vectors})


def run_join(spark, case: dict, check_rows: int) -> tuple[int, list[str]]:
    """Run one join; (rows checked, problems)."""
    from nearest_join import nearest_by_join

    Q, T, metric, k = case["Q"], case["T"], case["metric"], case["k"]
    q = spark.createDataFrame(_arrow_side(Q, case["q_null"], "qid", "qv")).repartition(case["q_parts"])
    t = spark.createDataFrame(_arrow_side(T, case["t_null"], "tid", "tv")).repartition(case["t_parts"])
    out = nearest_by_join(q, t, metric, k, vectors=("qv", "tv"), join_type=case["join_type"],
                          distance_col="d", **case["options"]).collect()
    problems = []
    q_ok = _rankable(Q, case["q_null"], metric)
    t_ok = np.flatnonzero(_rankable(T, case["t_null"], metric))
    per_query: dict[int, list] = {}
    for r in out:
        per_query.setdefault(r["qid"], []).append((r["d"], r["tid"]))
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
    if set(per_query) - set(range(Q.shape[0])):
        problems.append(f"unknown query ids {sorted(set(per_query) - set(range(Q.shape[0])))[:5]}")
    checked = np.flatnonzero(q_ok)
    if expected_count and checked.size and not problems:
        rng = np.random.default_rng(case["seed"])
        checked = np.sort(rng.choice(checked, min(check_rows, checked.size), replace=False))
        descending = metric in ("cosine", "inner_product")
        values = np.full((checked.size, k), -np.inf if descending else np.inf, np.float32)
        indices = np.full((checked.size, k), -1, np.int64)
        position = {int(j): p for p, j in enumerate(t_ok)}
        for slot, i in enumerate(checked):
            found = sorted(per_query[int(i)], key=lambda p: -p[0] if descending else p[0])
            values[slot, :len(found)] = [v for v, _ in found]
            indices[slot, :len(found)] = [position[tid] for _, tid in found]
        Qc, Tc = Q[checked], T[t_ok]
        all_keys = adversarial.oracle_keys(Qc, Tc, metric)
        keys = np.sort(all_keys, axis=1)[:, expected_count - 1]
        # Values that leave float32's normal range (inf, or a subnormal/0 for a nonzero key)
        # tie in the merge of target blocks: such rows are not rank-checked.
        kth_value = np.abs(adversarial.key_values(keys, metric))
        best_value = np.abs(adversarial.key_values(np.sort(all_keys, axis=1)[:, 0], metric))
        fits = (kth_value < 3e38) & ((best_value > 1.2e-38) | (np.sort(all_keys, axis=1)[:, 0] == 0))
        fits &= (np.abs(adversarial.key_values(all_keys, metric)) < 3e38).all(axis=1) | (metric == "l2")
        values, indices, checked, keys = values[fits], indices[fits], checked[fits], keys[fits]
        Qc = Qc[fits]
        scale = adversarial.key_scale(Qc, Tc, metric)
        rounding = VALUE_RTOL * (np.maximum(np.abs(keys), 2.0) if metric == "cosine" else np.abs(keys))
        rtol = float(np.max(rounding / np.maximum(scale, 1e-300), initial=0.0)) + 1e-12
        if checked.size:
            try:
                adversarial.assert_true_topk(Qc, Tc, k, metric, values, indices, rtol,
                                             case=f"seed {case['seed']}")
            except AssertionError as exc:
                problems.append(str(exc)[:2000])
    return int(checked.size), problems


def describe(case: dict) -> str:
    return (f"seed={case['seed']} kind={case['kind']} nq={case['Q'].shape[0]} nt={case['T'].shape[0]} "
            f"d={case['Q'].shape[1]} dtype={case['Q'].dtype} k={case['k']} metric={case['metric']} "
            f"join={case['join_type']} parts={case['q_parts']}/{case['t_parts']} options={case['options']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000 * 1000)
    parser.add_argument("--replay", type=int, help="run only the join of this seed")
    parser.add_argument("--check-rows", type=int, default=200)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("nearest_join-stress")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "4").config("spark.task.maxFailures", "1")
             .config("spark.driver.memory", "3g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    seeds = [args.replay] if args.replay is not None else None
    start = time.monotonic()
    joins = rows_checked = 0
    mismatches, crashes = [], []
    i = 0
    while True:
        if seeds is not None:
            if i >= len(seeds):
                break
            seed = seeds[i]
        else:
            if time.monotonic() - start > args.minutes * 60:
                break
            seed = args.seed + i
        i += 1
        case = draw(seed)
        try:
            checked, problems = run_join(spark, case, args.check_rows)
        except Exception as exc:  # noqa: BLE001 (a crash is a finding: record it, go on)
            crashes.append(seed)
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            print(f"CRASH {describe(case)}\n  {last[:1500]}", flush=True)
            continue
        joins += 1
        rows_checked += checked
        if problems:
            mismatches.append(seed)
            print(f"MISMATCH {describe(case)}\n  " + "\n  ".join(problems[:5]), flush=True)
        if joins % 25 == 0:
            print(f"... {joins} joins, {rows_checked} rows checked, {len(mismatches)} mismatches, "
                  f"{len(crashes)} crashes, {time.monotonic() - start:.0f} s", flush=True)
    elapsed = time.monotonic() - start
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    summary = dict(date=datetime.date.today().isoformat(), commit=commit, master=args.master,
                   first_seed=args.seed if args.replay is None else args.replay,
                   minutes=round(elapsed / 60, 1), joins=joins, rows_checked=rows_checked,
                   mismatches=mismatches, crashes=crashes,
                   openblas_coretype=os.environ.get("OPENBLAS_CORETYPE", "unset"))
    print(json.dumps(summary))
    if args.replay is None:
        Recorder("stress", gpu=False).add(
            "totals", master=args.master, first_seed=args.seed, minutes=round(elapsed / 60, 1), joins=joins,
            rows_checked=rows_checked, mismatches=mismatches, crashes=crashes, check_rows=args.check_rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(json.dumps(summary) + "\n")
    spark.stop()
    return 1 if mismatches or crashes else 0


if __name__ == "__main__":
    sys.exit(main())
