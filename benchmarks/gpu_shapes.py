"""GPU search at embedding sizes: first-call compile time per configuration, and the exact
search (precision "auto" and each precision) against plain torch ``addmm`` + ``topk`` and the
bf16 GEMM alone, with every exact result checked against a float64 oracle on sampled rows.

Run on a CUDA machine: ``python benchmarks/gpu_shapes.py [--quick] [--budget-s 500]``.
Records go to ``benchmarks/results/gpu_kernel.jsonl`` (tables ``compile`` and ``shapes``).
Data: Gaussian rows with a per-dimension offset (non-centred, like real embeddings); no real
embeddings can be downloaded on the device.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from nearest_join.kernels.gpu import knn_torch, resolve_precision  # noqa: E402


def events_ms(fn, reps: int) -> float:
    """Median of ``reps`` timed calls (CUDA events), after one warm call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def data(n, d, gen, offset):
    x = torch.randn((n, d), generator=gen, device="cuda")
    return (x + offset).contiguous()


def addmm_topk(Q, T, k, dtype, chunk=8192):
    """Plain squared-l2 top-k: |t|^2 - 2 q.t by chunked addmm in ``dtype``, then topk."""
    Tc = T.to(dtype)
    bias = (T.float() ** 2).sum(1).to(dtype)
    vs, ix = [], []
    for r0 in range(0, Q.shape[0], chunk):
        s = torch.addmm(bias[None, :], Q[r0:r0 + chunk].to(dtype), Tc.T, beta=1, alpha=-2)
        v, i = torch.topk(s, k, dim=1, largest=False)
        vs.append(v)
        ix.append(i)
    return torch.cat(vs), torch.cat(ix)


def gemm_alone(Q, T, chunk=8192):
    Tc = T.to(torch.bfloat16)
    out = torch.empty((chunk, T.shape[0]), dtype=torch.bfloat16, device="cuda")
    for r0 in range(0, Q.shape[0], chunk):
        q = Q[r0:r0 + chunk].to(torch.bfloat16)
        torch.mm(q, Tc.T, out=out[:q.shape[0]])


def wrong_rows(Q, T, k, idx, sample):
    """Sampled rows whose returned set differs from the float64 difference-form top k by more
    than ties at the k-th distance (squared distances compared: no square root rounding)."""
    rows = torch.linspace(0, Q.shape[0] - 1, sample, device="cuda").long()
    q = Q[rows].double()
    t = T.double()
    d2 = ((q * q).sum(1, keepdim=True) - 2 * q @ t.T + (t * t).sum(1)[None, :]).clamp(min=0)
    kth = torch.topk(d2, k, dim=1, largest=False).values[:, -1]
    got = torch.gather(d2, 1, idx[rows].clamp(min=0))
    scale = (kth.abs() + 1e-30)
    bad = ((got - kth[:, None]) / scale[:, None] > 1e-5).any(dim=1) | (idx[rows] < 0).any(dim=1)
    return int(bad.sum())


def compile_cases(args, rec):
    """First call (compilation included, fresh Triton cache) against the warm call, per
    (precision, d, k) at 2,048 x 60,000: the worst case a new executor pays."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    gen = torch.Generator(device="cuda").manual_seed(1)
    start = time.time()
    dims = [64, 128, 384, 768] if args.quick else [64, 96, 128, 256, 384, 768, 1536]
    for precision in ("bf16", "tf32"):
        for d in dims:
            for k in (10, 100, 1000):
                if time.time() - start > args.compile_budget_s:
                    print(f"compile budget spent: skipped {precision} d={d} k={k}", flush=True)
                    continue
                Q, T = data(2048, d, gen, 1.0), data(60_000, d, gen, 1.0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                knn_torch(Q, T, k, "l2", precision)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                knn_torch(Q, T, k, "l2", precision)
                torch.cuda.synchronize()
                warm = time.perf_counter() - t0
                row = dict(precision=precision, d=d, k=k, nq=2048, nt=60_000,
                           first_call_s=round(first, 2), warm_s=round(warm, 4),
                           compile_s=round(first - warm, 2))
                print(row, flush=True)
                rec.add("compile", **row)


def shape_cases(args, rec):
    gen = torch.Generator(device="cuda").manual_seed(2)
    auto = resolve_precision("auto", torch.device("cuda"))
    shapes = [(65_536, 1_000_000, "65,536 x 10^6"), (63_681, None, "self-join 63,681")]
    if args.quick:
        shapes = [(8192, 100_000, "8,192 x 10^5"), (6_000, None, "self-join 6,000")]
    dims = [int(x) for x in args.dims.split(",")]
    start = time.time()
    for d in dims:
        offset = torch.randn(d, generator=gen, device="cuda") * 0.5
        for nq, nt, label in shapes:
            T = data(nt or nq, d, gen, offset)
            Q = T if nt is None else data(nq, d, gen, offset)
            for k in (10, 100):
                if time.time() - start > args.budget_s:
                    print(f"budget spent: skipped d={d} {label} k={k}", flush=True)
                    continue
                row = dict(shape=label, nq=Q.shape[0], nt=T.shape[0], d=d, k=k, auto=auto)
                row["gemm_bf16_ms"] = round(events_ms(lambda: gemm_alone(Q, T), args.reps), 1)
                row["torch_fp32_addmm_topk_ms"] = round(events_ms(lambda: addmm_topk(Q, T, k, torch.float32),
                                                                  args.reps), 1)
                row["torch_bf16_addmm_topk_ms"] = round(events_ms(lambda: addmm_topk(Q, T, k, torch.bfloat16),
                                                                  args.reps), 1)
                _, bi = addmm_topk(Q, T, k, torch.bfloat16)
                row["torch_bf16_wrong_of_sample"] = wrong_rows(Q, T, k, bi, args.sample)
                for precision in ("auto", "bf16", "tf32", "fp32"):
                    if precision == auto:
                        continue
                    name = precision if precision != "auto" else f"exact_auto_{auto}"
                    _, idx = knn_torch(Q, T, k, "l2", precision)
                    row[f"{name}_wrong_of_sample"] = wrong_rows(Q, T, k, idx, args.sample)
                    row[f"{name}_ms"] = round(events_ms(lambda p=precision: knn_torch(Q, T, k, "l2", p),
                                                        args.reps), 1)
                row["sample_rows"] = args.sample
                a = row[f"exact_auto_{auto}_ms"]
                row["auto_over_gemm"] = round(a / row["gemm_bf16_ms"], 2)
                row["auto_over_torch_fp32"] = round(a / row["torch_fp32_addmm_topk_ms"], 2)
                print(row, flush=True)
                rec.add("shapes", **row)
            del Q, T
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dims", default="384,768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sample", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--compile-budget-s", type=float, default=200)
    ap.add_argument("--only", choices=["compile", "shapes", "both"], default="both")
    args = ap.parse_args(argv)
    from _record import Recorder

    rec = Recorder("gpu_kernel", blas=False)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if args.only in ("compile", "both"):
        compile_cases(args, rec)
    if args.only in ("shapes", "both"):
        shape_cases(args, rec)


if __name__ == "__main__":
    main()
