"""Where a configuration's first call spends its compile time: every Triton compilation it
triggers (kernel, constexpr specialisation, seconds, launched or compiled-only, the thread), per
(precision, d, k), each in its own fresh process with an empty Triton cache.

Run on a CUDA machine: ``python benchmarks/gpu_compile_trace.py bf16:3:1 bf16:4096:10 ...
[--workers 6] [--out trace.jsonl]``. Same data as ``gpu_shapes.py``'s compile table (2,048 x
60,000, l2, Gaussian + 1; ``--nq``/``--nt`` another shape). A diagnostic: prints, records nothing in RESULTS.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def trace(precision: str, d: int, k: int, nq: int = 2048, nt: int = 60_000) -> dict:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    import torch
    from triton.runtime.jit import JITFunction

    from nearest_kernels.gpu import knn_torch

    compiles = []
    began = [time.perf_counter()]   # the call's start, reset before it
    real = JITFunction._do_compile

    def timed(self, key, signature, device, constexprs, options, attrs, warmup):
        t0 = time.perf_counter()
        out = real(self, key, signature, device, constexprs, options, attrs, warmup)
        shown = {str(k[0] if isinstance(k, tuple) else k): v for k, v in constexprs.items()
                 if not isinstance(v, (type(None),)) and str(v)[:1] != "<"}
        compiles.append(dict(kernel=self.fn.__name__, seconds=round(time.perf_counter() - t0, 2),
                             start_s=round(t0 - began[0], 2),
                             warmup=bool(warmup), thread=threading.current_thread().name,
                             constexprs=str(shown)[:400]))
        return out

    JITFunction._do_compile = timed
    from triton.backends.nvidia import driver as nvidia_driver

    launcher_init = nvidia_driver.CudaLauncher.__init__

    def timed_launcher(self, src, metadata):
        # A kernel's launcher: a C module built per signature on a fresh cache, at first launch.
        t0 = time.perf_counter()
        launcher_init(self, src, metadata)
        compiles.append(dict(kernel=f"launcher of {getattr(src, 'name', '?')}",
                             seconds=round(time.perf_counter() - t0, 2), start_s=round(t0 - began[0], 2),
                             warmup=False, thread=threading.current_thread().name, constexprs=""))

    nvidia_driver.CudaLauncher.__init__ = timed_launcher
    gen = torch.Generator(device="cuda").manual_seed(1)
    offset = 1.0
    Q = torch.randn((nq, d), generator=gen, device="cuda") + offset
    T = torch.randn((nt, d), generator=gen, device="cuda") + offset
    torch.cuda.synchronize()
    t0 = began[0] = time.perf_counter()
    knn_torch(Q, T, k, "l2", precision)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    return dict(precision=precision, d=d, k=k, first_call_s=round(first, 2),
                compile_s=round(sum(c["seconds"] for c in compiles), 2), compiles=compiles)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", help="precision:d:k")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--nq", type=int, default=2048)
    ap.add_argument("--nt", type=int, default=60_000)
    args = ap.parse_args(argv)
    cases = [(p, int(d), int(k)) for p, d, k in (c.split(":") for c in args.cases)]
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"),
                                                max_tasks_per_child=1) as pool:
        results = list(pool.map(trace, *zip(*cases), [args.nq] * len(cases), [args.nt] * len(cases)))
    for r in results:
        print(f"{r['precision']} d={r['d']} k={r['k']}: first call {r['first_call_s']} s, "
              f"{len(r['compiles'])} compilations {r['compile_s']} s")
        for c in r["compiles"]:
            print(f"    {c['seconds']:6.2f} s from {c['start_s']:5.2f}  {c['kernel']}{' (compile only)' if c['warmup'] else ''} "
                  f"[{c['thread']}]  {c['constexprs']}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
