"""How fast the fused kernel's loop could be with no list work: a diagnostic.

A minimal Triton kernel with the register-list kernel's structure (one program per query
tile and target segment, strided target tiles, d in chunks in one flat (tile, chunk) loop,
both operands by TMA, one FMA per key) that keeps only each row's minimum key: the ceiling
of that loop for a tile shape, against the bf16 GEMM alone (``gpu_kernel.gemm_alone``) on the
same rows, and the library's first candidate pass (``_gpu_triton.triton_candidates``) where
asked. Shapes: ``BMxBNxBD/warps/stages``.

Run on a CUDA machine: ``python benchmarks/gpu_ceiling.py [--dims 384,1536] [--nq 65536]
[--nt 1000000] [--configs 128x128x128/8/3,...] [--budget-s 200]``. Prints JSON lines;
records nothing in RESULTS.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gpu_kernel import cuda_ms, gemm_alone  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402


@triton.jit
def _ceiling_kernel(q_desc, t_desc, bias_ptr, out_ptr, nq, nt, d,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    NESTED: tl.constexpr, STAGES: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_splits = tl.num_programs(1)
    m0 = pid_m * BLOCK_M
    n_tiles = tl.cdiv(tl.cdiv(nt, BLOCK_N) - pid_s, n_splits)
    n_chunks = (d + BLOCK_D - 1) // BLOCK_D
    offs_n = tl.arange(0, BLOCK_N)
    low = tl.full([BLOCK_M], float("inf"), tl.float32)
    if NESTED:
        for tile in range(0, n_tiles):
            n0 = (pid_s + tile * n_splits) * BLOCK_N
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for c in tl.range(0, n_chunks, num_stages=STAGES):
                a = q_desc.load([m0, c * BLOCK_D])
                b = tl.trans(t_desc.load([n0, c * BLOCK_D]))
                acc = tl.dot(a, b, acc)
            cols = n0 + offs_n
            bias = tl.load(bias_ptr + cols, mask=cols < nt, other=float("inf"))
            low = tl.minimum(low, tl.min(tl.fma(acc, -2.0, bias[None, :]), axis=1))
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for it in range(0, n_tiles * n_chunks):
            tile = it // n_chunks
            c = it - tile * n_chunks
            n0 = (pid_s + tile * n_splits) * BLOCK_N
            a = q_desc.load([m0, c * BLOCK_D])
            b = tl.trans(t_desc.load([n0, c * BLOCK_D]))
            acc = tl.dot(a, b, acc)
            if c == n_chunks - 1:
                cols = n0 + offs_n
                bias = tl.load(bias_ptr + cols, mask=cols < nt, other=float("inf"))
                low = tl.minimum(low, tl.min(tl.fma(acc, -2.0, bias[None, :]), axis=1))
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    rows = m0 + tl.arange(0, BLOCK_M)
    tl.store(out_ptr + pid_s * nq + rows, low, mask=rows < nq)


def parse(config: str):
    tiles, warps, stages = config.split("/")
    nested = tiles.startswith("n")
    bm, bn, bd = (int(x) for x in tiles.lstrip("n").split("x"))
    return bm, bn, bd, int(warps), int(stages), nested


def ceiling_ms(q, t, bias, config: str, splits: int, reps: int) -> dict:
    bm, bn, bd, warps, stages, nested = parse(config)
    q_desc = TensorDescriptor.from_tensor(q, [bm, bd])
    t_desc = TensorDescriptor.from_tensor(t, [bn, bd])
    out = torch.empty((splits, q.shape[0]), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(q.shape[0], bm), splits)

    def run():
        _ceiling_kernel[grid](q_desc, t_desc, bias, out, q.shape[0], t.shape[0], q.shape[1],
                              BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, NESTED=nested, STAGES=stages,
                              num_warps=warps, num_stages=stages)

    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    compiled = _ceiling_kernel.warmup(q_desc, t_desc, bias, out, q.shape[0], t.shape[0], q.shape[1],
                                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, NESTED=nested, STAGES=stages,
                                      num_warps=warps, num_stages=stages, grid=grid)
    ms = statistics.median(cuda_ms(run, reps))
    return dict(config=config, splits=splits, ms=round(ms, 1), compile_s=round(compile_s, 1),
                registers=compiled.n_regs, spills=compiled.n_spills, shared=compiled.metadata.shared,
                tflops=round(2 * q.shape[0] * t.shape[0] * q.shape[1] / ms / 1e9))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="384,1536")
    ap.add_argument("--nq", type=int, default=65_536)
    ap.add_argument("--nt", type=int, default=1_000_000)
    ap.add_argument("--splits", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", default="128x128x128/8/3,128x128x64/8/3,128x128x64/8/4,"
                                         "n128x128x64/8/3,128x256x64/8/3,256x128x64/8/3,256x128x64/16/3,"
                                         "256x128x128/16/2")
    ap.add_argument("--library", action="store_true", help="also the library's first pass at k=10")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    out = open(Path(args.out) / "ceiling.jsonl", "a") if args.out else None
    gen = torch.Generator(device="cuda").manual_seed(2)
    for d in (int(x) for x in args.dims.split(",")):
        offset = torch.randn(d, generator=gen, device="cuda") * 0.5
        Q = torch.randn((args.nq, d), generator=gen, device="cuda") + offset
        T = torch.randn((args.nt, d), generator=gen, device="cuda") + offset
        bias = (T * T).sum(1)
        gemm = statistics.median(cuda_ms(lambda: gemm_alone(Q, T, bias, "bf16"), args.reps))
        q, t = Q.bfloat16().contiguous(), T.bfloat16().contiguous()
        rows = []
        if args.library:
            from nearest_kernels import _gpu_torch as gt
            from nearest_kernels import _gpu_triton as tr
            from nearest_kernels import gpu
            prepared = gpu.prepare_targets(T, "l2")
            qs = gt.prepare_queries(Q, prepared.side)
            n_cand = gt.candidate_width(10, "bf16", gpu.uses_lower_keys(10, "bf16", d))
            tr.triton_candidates(qs, prepared.side, n_cand)
            ms = statistics.median(cuda_ms(lambda: tr.triton_candidates(qs, prepared.side, n_cand),
                                           args.reps))
            rows.append(dict(config="library k=10 first pass", ms=round(ms, 1)))
            del prepared, qs
        for config in args.configs.split(","):
            if time.perf_counter() - start > args.budget_s:
                rows.append(dict(config=config, skipped="budget"))
                continue
            try:
                rows.append(ceiling_ms(q, t, bias, config, args.splits, args.reps))
            except Exception as exc:   # a configuration that does not fit is a finding
                rows.append(dict(config=config, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
        for row in rows:
            row.update(d=d, gemm_bf16_ms=round(gemm, 1))
            if "ms" in row:
                row["over_gemm"] = round(row["ms"] / gemm, 2)
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
        del Q, T, q, t, bias
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
