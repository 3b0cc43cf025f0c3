"""A GPU worker's first block with and without the searcher's warm-up (issue 20).

Each case runs in a fresh Python process with its own empty Triton cache (a new executor's
worker on a machine that has compiled nothing): it opens a :class:`udfs.gpu.GpuBlockSearcher`
(with ``SearchSettings.warm_shape`` set to the block pair's shape, or None), then searches a
first and a second block pair of that shape (other target rows each), and reports the seconds
of each step. Without the warm-up the first search pays the Triton compiles; with it, the
opening does, and the first search should cost what the second does.

    python3 benchmarks/gpu_warm_up.py [--out DIR] [--nq 4096 --nt 100000 --d 768 --k 10]

Records go to ``benchmarks/results/gpu_warm_up.jsonl`` (``--out``: that directory instead, for
a device whose results come back through it), table ``first_block``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def child(args) -> dict:
    import numpy as np
    import torch

    from udfs.gpu import GpuBlockSearcher
    from udfs.context import SearchSettings

    rng = np.random.default_rng(0)
    q = rng.standard_normal((args.nq, args.d), dtype=np.float32)
    blocks = [rng.standard_normal((args.nt, args.d), dtype=np.float32) for _ in range(2)]
    warm = (args.nq, args.nt, args.d, "float32", "float32") if args.case == "warm" else None
    settings = SearchSettings(args.k, args.metric, "gpu", args.precision, warm_shape=warm)
    device = torch.device("cuda", 0)
    torch.cuda.init()
    torch.empty(1, device=device)              # the CUDA context, outside every timing
    t0 = time.perf_counter()
    searcher = GpuBlockSearcher(settings, device)
    torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    searcher.search(q, blocks[0], target_key=0)
    t2 = time.perf_counter()
    searcher.search(q, blocks[1], target_key=1)
    t3 = time.perf_counter()
    return dict(case=args.case, nq=args.nq, nt=args.nt, d=args.d, k=args.k, metric=args.metric,
                precision=searcher.precision, open_s=t1 - t0, first_block_s=t2 - t1, second_block_s=t3 - t2,
                device=torch.cuda.get_device_name(device))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--nq", type=int, default=4096)
    ap.add_argument("--nt", type=int, default=100_000)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--metric", default="cosine")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--case", choices=["cold", "warm"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case is not None:
        print(json.dumps(child(args)))
        return
    from benchmarks._record import Recorder

    rec = Recorder("gpu_warm_up", blas=False, results_dir=Path(args.out) if args.out else None)
    rows = []
    for case in ("cold", "warm"):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONPATH=str(REPO))
            cmd = [sys.executable, __file__, "--case", case] + [
                f"--{name}={getattr(args, name)}" for name in ("nq", "nt", "d", "k", "metric", "precision")]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
            rec.add("first_block", **rows[-1])


if __name__ == "__main__":
    main()
