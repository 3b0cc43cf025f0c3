"""GPU search at embedding sizes (offset Gaussian rows, like real embeddings): each configuration's
first-call compile time (tables ``compile``, ``compile_few_targets``), and the exact search against
plain torch ``addmm`` + ``topk`` and the bf16 GEMM alone, checked against a float64 oracle (``shapes``).

    python benchmarks/gpu_shapes.py [--only compile|shapes] [--dims 384,768,1536]   # a CUDA machine
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._record import Recorder, cuda_ms  # noqa: E402
from nearest_kernels.gpu import knn_torch, resolve_precision  # noqa: E402
from tests import oracle  # noqa: E402
from tests.kernels.test_gpu_shapes import DIMS as DEVICE_TEST_DIMS  # noqa: E402


CHUNK_ROWS = 4096   # query rows per addmm chunk in the torch baselines (4096 x 1e6 floats = 16 GB)


def addmm_topk(Q, T, bias, precision, k=None):
    """Plain squared-l2 top-k indices: ``bias - 2 q.t`` by chunked ``addmm`` in ``precision``
    (``bias`` = |t|^2), then ``topk``: the naive search, no re-rank. ``k`` None: the GEMM
    alone (each chunk's (chunk, nt) matrix written, no top-k; returns None)."""
    q, t = (Q.bfloat16(), T.bfloat16()) if precision == "bf16" else (Q, T)
    b = bias.to(q.dtype)
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    out = []
    for r0 in range(0, q.shape[0], CHUNK_ROWS):
        d = torch.addmm(b, q[r0:r0 + CHUNK_ROWS], t.T, alpha=-2.0)
        if k is not None:
            out.append(torch.topk(d, k, dim=1, largest=False).indices)
    return torch.cat(out) if k is not None else None


def wall(fn) -> tuple[float, object]:
    """(seconds, result) of one call of ``fn``, until the GPU has finished it (idle before)."""
    t0 = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, result


def data(n, d, gen, offset):
    x = torch.randn((n, d), generator=gen, device="cuda")
    return (x + offset).contiguous()


DEVICE = "cuda"   # where the oracle's keys are computed


def _device_oracle(T_host: np.ndarray, T: torch.Tensor):
    """tests.oracle's ``oracle_keys`` and ``key_scale`` for l2, computed on the device by the
    same float64 formulas (the difference form sum((q - t)^2); (|q - c| + max |t - c|)^2),
    reading the targets from ``T`` (already there) when asked about ``T_host`` (the CPU would
    take minutes at 10^6 targets)."""
    def targets_of(targets):
        return T if targets is T_host else torch.from_numpy(targets).to(DEVICE)

    def oracle_keys(queries, targets, metric):
        assert metric == "l2", metric
        q = torch.from_numpy(queries).to(DEVICE).double()
        t = targets_of(targets)
        keys = torch.empty((q.shape[0], t.shape[0]), dtype=torch.float64, device=DEVICE)
        step = max(1, (1 << 28) // max(1, q.numel()))
        for c0 in range(0, t.shape[0], step):
            diff = q[:, None, :] - t[c0:c0 + step].double()[None, :, :]
            keys[:, c0:c0 + step] = (diff * diff).sum(2)
        return keys.cpu().numpy()

    def key_scale(queries, targets, metric):
        assert metric == "l2", metric
        q = torch.from_numpy(queries).to(DEVICE).double()
        t = targets_of(targets)
        c = t.double().mean(0)
        far = max(float((t[r0:r0 + 65536].double() - c).norm(dim=1).max()) for r0 in range(0, t.shape[0], 65536))
        return ((q - c).norm(dim=1) + far).pow(2).cpu().numpy()

    return oracle_keys, key_scale


def wrong_rows(Q, T, T_host, k, idx, sample, values=None) -> int:
    """Sampled rows that are not a true top k of the tests' oracle: ``tests.oracle.
    assert_true_topk`` (float64 difference form, ties within the gpu backend's RTOL), its
    keys and scale computed on the device by the same formulas (:func:`_device_oracle`).
    ``T_host``: ``T`` on the host. ``values`` None (a plain search whose values are not
    exact): the oracle's own values of the returned pairs, so only the choice of targets is
    judged."""
    rows = torch.linspace(0, Q.shape[0] - 1, sample, device=DEVICE).long()
    got = idx[rows]
    if values is None:
        picked = T[got.clamp(min=0)].double() - Q[rows].double()[:, None, :]
        v = picked.pow(2).sum(2).sqrt().float().cpu().numpy()
    else:
        v = values[rows].cpu().numpy()
    saved = oracle.oracle_keys, oracle.key_scale
    oracle.oracle_keys, oracle.key_scale = _device_oracle(T_host, T)
    try:
        oracle.assert_true_topk(Q[rows].cpu().numpy(), T_host, k, "l2", v, got.cpu().numpy(),
                                oracle.backend_rtol("gpu"))
        return 0
    except AssertionError as exc:
        return int(re.search(r": (\d+) of \d+ rows wrong", str(exc)).group(1))
    finally:
        oracle.oracle_keys, oracle.key_scale = saved


COMPILE_DIMS = DEVICE_TEST_DIMS   # the worst case over the device tests' matrix
COMPILE_KS = [1, 10, 100, 1000]


def first_call(precision: str, d: int, k: int, nt: int = 60_000) -> dict:
    """One configuration's first call in a fresh process with an empty Triton cache (what a
    new executor pays), against the same call warm; 2,048 x ``nt``, l2."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    gen = torch.Generator(device="cuda").manual_seed(1)
    Q, T = data(2048, d, gen, 1.0), data(nt, d, gen, 1.0)
    torch.cuda.synchronize()
    first, warm = (wall(lambda: knn_torch(Q, T, k, "l2", precision))[0] for _ in range(2))
    return dict(precision=precision, d=d, k=k, nq=2048, nt=nt, first_call_s=round(first, 2),
                warm_s=round(warm, 4), compile_s=round(first - warm, 2))


def compile_cases(args, rec):
    """First call (compilation included) per (precision, d, k), each in its own fresh process
    (``--compile-workers`` at a time: compilation is single-threaded and CPU-bound)."""
    import concurrent.futures
    import multiprocessing

    dims = [int(x) for x in args.compile_dims.split(",")] if args.compile_dims else COMPILE_DIMS
    # Targets too few for the segments at k >= 50 (the device tests' 5,003): one register
    # list or the torch path, another table.
    table = "compile" if args.compile_nt == 60_000 else "compile_few_targets"
    cases = [(p, d, k, args.compile_nt) for p in ("bf16", "tf32", "fp32") for d in dims for k in COMPILE_KS]
    start = time.time()
    rows = []
    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=args.compile_workers, mp_context=multiprocessing.get_context("spawn"),
        max_tasks_per_child=1)
    futures = {pool.submit(first_call, *case): case for case in cases}
    try:
        for fut in concurrent.futures.as_completed(futures, timeout=args.compile_budget_s):
            try:
                row = fut.result()
            except Exception as exc:   # a failed first call is a finding: record it
                p, d, k, nt = futures[fut]
                row = dict(precision=p, d=d, k=k, nt=nt, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            row["processes_at_once"] = args.compile_workers
            print(row, flush=True)
            rec.add(table, **row)
            rows.append(row)
    except concurrent.futures.TimeoutError:
        print(f"compile budget spent after {time.time() - start:.0f} s: {len(cases) - len(rows)} cases "
              "not measured", flush=True)
    for process in list(pool._processes.values()):   # cases still compiling: they would load what follows
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def triton_cache_state() -> str:
    """``"fresh"`` when the Triton cache this process uses holds no compiled kernel yet (the
    shapes' first calls then include compilation), else ``"warm"``."""
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return "warm" if cache.is_dir() and any(cache.iterdir()) else "fresh"


def shape_cases(args, rec):
    cache = triton_cache_state()
    gen = torch.Generator(device="cuda").manual_seed(2)
    auto = resolve_precision("auto", torch.device("cuda"))
    shapes = [(65_536, 1_000_000, "65,536 x 10^6"), (63_681, None, "self-join 63,681")]
    dims = [int(x) for x in args.dims.split(",")]
    start = time.time()
    for d in dims:
        offset = torch.randn(d, generator=gen, device="cuda") * 0.5
        for nq, nt, label in shapes:
            T = data(nt or nq, d, gen, offset)
            Q = T if nt is None else data(nq, d, gen, offset)
            T_host = T.cpu().numpy()
            for k in (10, 100):
                if time.time() - start > args.budget_s:
                    print(f"budget spent: skipped d={d} {label} k={k}", flush=True)
                    continue
                row = dict(shape=label, nq=Q.shape[0], nt=T.shape[0], d=d, k=k, auto=auto,
                           triton_cache=cache)
                bias = (T * T).sum(1)
                row["gemm_bf16_ms"] = round(cuda_ms(lambda: addmm_topk(Q, T, bias, "bf16"), args.reps), 1)
                row["torch_fp32_addmm_topk_ms"] = round(cuda_ms(lambda: addmm_topk(Q, T, bias, "fp32", k),
                                                                  args.reps), 1)
                row["torch_bf16_addmm_topk_ms"] = round(cuda_ms(lambda: addmm_topk(Q, T, bias, "bf16", k),
                                                                  args.reps), 1)
                bi = addmm_topk(Q, T, bias, "bf16", k)
                row["torch_bf16_wrong_of_sample"] = wrong_rows(Q, T, T_host, k, bi, args.sample)
                name = f"exact_auto_{auto}"
                torch.cuda.synchronize()
                seconds, (v, idx) = wall(lambda: knn_torch(Q, T, k, "l2", "auto"))
                # Compilation included where this process has not compiled the kernel yet.
                row[f"{name}_first_call_s"] = round(seconds, 2)
                row[f"{name}_wrong_of_sample"] = wrong_rows(Q, T, T_host, k, idx, args.sample, v)
                row[f"{name}_ms"] = round(cuda_ms(lambda: knn_torch(Q, T, k, "l2", "auto"), args.reps), 1)
                row["sample_rows"] = args.sample
                a = row[f"exact_auto_{auto}_ms"]
                row["auto_over_gemm"] = round(a / row["gemm_bf16_ms"], 2)
                row["auto_over_torch_fp32"] = round(a / row["torch_fp32_addmm_topk_ms"], 2)
                print(row, flush=True)
                rec.add("shapes", **row)
            del Q, T, T_host
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="384,768")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sample", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--compile-budget-s", type=float, default=200)
    ap.add_argument("--compile-workers", type=int, default=12)
    ap.add_argument("--compile-nt", type=int, default=60_000, help="targets of the compile matrix's calls")
    ap.add_argument("--compile-dims", default=None, help="its dimensions (default: the device tests')")
    ap.add_argument("--only", choices=["compile", "shapes", "both"], default="both")
    ap.add_argument("--precisions", default="auto", help="no effect (kept for recorded commands)")
    args = ap.parse_args(argv)
    rec = Recorder("gpu_kernel", blas=False)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if args.only in ("compile", "both"):
        compile_cases(args, rec)
    if args.only in ("shapes", "both"):
        shape_cases(args, rec)
    rec.print_tables()


if __name__ == "__main__":
    main()
