"""Where an exact GPU search's time goes at embedding sizes: the target block's and the
queries' preparation, the candidate passes, the re-rank and each widening round (synchronised wall time per call), the compiled candidate
kernels' registers, spills and shared memory, and the candidate pass alone per launch
configuration, against the bf16 GEMM alone on the same rows.

Run on a CUDA machine: ``python benchmarks/gpu_stages.py [--cases 384:10,384:100]
[--nq 65536] [--nt 1000000] [--variants] [--out DIR]``. Data as ``gpu_shapes.py`` (Gaussian
rows with a per-dimension offset, l2). A diagnostic: prints JSON lines (and writes them to
``--out``), records nothing in RESULTS.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gpu_kernel import cuda_ms, gemm_alone  # noqa: E402

from nearest_kernels import _gpu_torch as gt  # noqa: E402
from nearest_kernels import _gpu_triton as tr  # noqa: E402
from nearest_kernels import gpu  # noqa: E402


def data(n, d, gen, offset):
    return (torch.randn((n, d), generator=gen, device="cuda") + offset).contiguous()


class Stages:
    """Wraps the search's stage functions: each call synchronised and timed, with its rows
    and list width; the compiled candidate kernels' resources from the launch check."""

    def __init__(self):
        self.calls, self.kernels = [], {}

    def wrap(self, module, name, label):
        real = getattr(module, name)

        def timed(*args, **kwargs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = real(*args, **kwargs)
            torch.cuda.synchronize()
            q = args[0]
            entry = dict(stage=label, ms=round((time.perf_counter() - t0) * 1e3, 2),
                         rows=getattr(q, "rows", None))
            if len(args) > 2 and isinstance(args[2], int):
                entry["n_cand"] = args[2]
            elif len(args) > 2 and isinstance(args[2], torch.Tensor):
                entry["columns"] = args[2].shape[1]
            entry.update({k: (v if isinstance(v, bool) else v is not None) for k, v in kwargs.items()
                          if k in ("seed", "lower")})
            self.calls.append(entry)
            return out

        setattr(module, name, timed)
        return real

    def watch_loads(self):
        real = tr._loads

        def loads(kernel, grid, args, kwargs, device):
            out = real(kernel, grid, args, kwargs, device)
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            shown = {k: v for k, v in kwargs.items() if k not in ("DOT_UPCAST",)}
            key = f"{kernel.fn.__name__} {shown}"
            if key not in self.kernels:
                self.kernels[key] = dict(registers=compiled.n_regs, spills=compiled.n_spills,
                                         shared=compiled.metadata.shared, grid=list(grid))
            return out

        tr._loads = loads


def prepare_ms(Q, T, reps) -> dict:
    """Device times of the target block's preparation (``gpu.prepare_targets``: inside
    ``knn_torch``, once per block on the executors) and of the queries' (every search)."""
    prepared = gpu.prepare_targets(T, "l2")
    return dict(prepare_targets_ms=round(statistics.median(cuda_ms(lambda: gpu.prepare_targets(T, "l2"), reps)), 1),
                prepare_queries_ms=round(statistics.median(cuda_ms(
                    lambda: gt.prepare_queries(Q, prepared.side), reps)), 1))


def stage_case(Q, T, k, reps, stages: Stages) -> dict:
    prepared = gpu.prepare_targets(T, "l2")
    torch.cuda.synchronize()
    search = lambda: gpu.search_prepared(Q, prepared, k)   # noqa: E731
    t0 = time.perf_counter()
    search()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    warm = statistics.median(cuda_ms(search, reps))
    stages.calls.clear()
    search()
    calls = list(stages.calls)
    return dict(first_call_s=round(first, 2), search_ms=round(warm, 1), calls=calls)


def pass_ms(qs, ts, n_cand, reps, **kw) -> float:
    return round(statistics.median(cuda_ms(lambda: tr.triton_candidates(qs, ts, n_cand, **kw), reps)), 1)


def variants(Q, T, k, reps, only=()) -> list[dict]:
    """The first candidate pass alone (the list width and keys the search uses) per launch
    configuration: the default, then stages, warps and row tiles, and d-chunks of 128."""
    prepared = gpu.prepare_targets(T, "l2")
    qs = gt.prepare_queries(Q, prepared.side)
    ts = prepared.side
    d = Q.shape[1]
    lower = gpu.uses_lower_keys(k, "bf16", d)
    n_cand = gt.candidate_width(k, "bf16", lower)
    base = tr.tile_config(n_cand, d, "bf16")
    configs = [("default", base, None)]
    configs.append(("stages4", dataclasses.replace(base, num_stages=4), None))
    configs.append(("n256", dataclasses.replace(base, block_n=256), None))
    configs.append(("bd128", base, 128))
    # 256-wide target tiles in 64-wide d-chunks: the loop alone (benchmarks/gpu_ceiling.py)
    # reaches the GEMM's speed in that shape, not in 128 x 128.
    for stages in (2, 3):
        configs.append((f"n256_bd64_s{stages}", dataclasses.replace(base, block_n=256, num_stages=stages,
                                                                  block_d=64), None))
    # One warpgroup of 64 rows, d in 64-chunks: shared memory and registers for two programs
    # per multiprocessor (one's list work overlapping the other's products).
    for stages in (3, 4):
        configs.append((f"m64w4_bd64_s{stages}", dataclasses.replace(
            base, block_m=64, num_warps=4, num_stages=stages, block_d=64), None))
    configs.append(("m64w4_bd128_s2", dataclasses.replace(base, block_m=64, num_warps=4, num_stages=2,
                                                          block_d=128), None))
    if n_cand <= tr.ROWLIST_MAX:
        configs.append(("one_list", tr.TileConfig(128, tr.BLOCK_N, 8, num_stages=3, kernel="rowlist"), None))
    rows = []
    for name, cfg, block_d in configs:
        if only and name not in only:
            continue
        saved = tr.BLOCK_D
        if block_d:
            tr.BLOCK_D = block_d
        try:
            plan = tr.plan_candidates(qs.rows, ts.rows, d, n_cand, "bf16", tr.device_limits(Q.device),
                                      config=cfg)[0]
            t0 = time.perf_counter()
            tr.triton_candidates(qs, ts, n_cand, config=cfg, lower=lower)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            ms = pass_ms(qs, ts, n_cand, reps, config=cfg, lower=lower)
            rows.append(dict(variant=name, ms=ms, compile_s=round(compile_s, 1),
                             tflops=round(2 * qs.rows * ts.rows * d / ms / 1e9, 0),
                             plan=dict(block_m=plan.config.block_m, warps=plan.config.num_warps,
                                       stages=plan.config.num_stages, block_d=plan.block_d,
                                       single_dot=plan.single_dot, t_desc=plan.t_desc,
                                       kernel=plan.config.kernel, n_splits=plan.n_splits)))
        except Exception as exc:   # a configuration that does not fit is a finding
            rows.append(dict(variant=name, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
        finally:
            tr.BLOCK_D = saved
        print(json.dumps(rows[-1]), flush=True)
    return rows


def widths(Q, T, k, reps, stages: Stages) -> list[dict]:
    """The whole search with its first list ``W`` wide (``candidate_width`` patched), and with
    a first list of 512 seeded by the 32nd key of a pass over 1/16 of the targets: time,
    rows each round left, and agreement with the shipped search."""
    prepared = gpu.prepare_targets(T, "l2")
    ref_v, ref_i = gpu.search_prepared(Q, prepared, k)
    real_width = gt.candidate_width
    rows = []
    try:
        for width in (128, 256, 512, "sampled512"):
            n = 512 if width == "sampled512" else width
            gt.candidate_width = lambda k, precision, lower=False, n=n: n
            if width == "sampled512":
                side = gt.prepare_queries(Q, prepared.side)
                lower = gpu.uses_lower_keys(k, "bf16", Q.shape[1])
                tiles = []

                def gen(q, t, n_cand, seed=None, lower=False):
                    if not tiles:
                        tiles.append(tr.search_tiles(q.rows, t.rows, q.dim, n_cand, q.precision,
                                                     tr.device_limits(q.exact.device)))
                    if seed is None:
                        sample = t.take(slice(0, t.rows // 16))
                        seed = tr.triton_candidates(q, sample, 32)[0][:, -1]
                    return tr.triton_candidates(q, t, n_cand, config=tiles[0], seed=seed, lower=lower)

                def search():
                    s = gt.prepare_queries(Q, prepared.side)
                    return gt.exact_topk(s, prepared.side, k, gen, max_candidates=tr.MAX_CANDIDATES,
                                         stats=prepared.stats, values=tr.triton_exact_values, seeded=True,
                                         lower=lower, few_rows=gt.TORCH_ROUND_ROWS)
            else:
                search = lambda: gpu.search_prepared(Q, prepared, k)   # noqa: E731
            v, i = search()
            same = float((i == ref_i).all(dim=1).float().mean())
            ms = statistics.median(cuda_ms(search, reps))
            stages.calls.clear()
            search()
            rows.append(dict(width=width, ms=round(ms, 1), same_rows=round(same, 5),
                             calls=[c for c in stages.calls if c["stage"] != "re-rank"]))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        gt.candidate_width = real_width
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="384:10,384:100,768:10,768:100,1536:10")
    ap.add_argument("--nq", type=int, default=65_536)
    ap.add_argument("--nt", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="", help="d:k cases whose pass runs per configuration")
    ap.add_argument("--only", default="", help="the --variants configurations to run (default: all)")
    ap.add_argument("--widths", default="", help="d:k cases searched with other first widths")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stages = Stages()
    stages.wrap(tr, "triton_candidates", "fused candidates")
    stages.wrap(tr, "triton_exact_values", "re-rank")
    stages.wrap(gt, "torch_candidates", "torch candidates")
    stages.watch_loads()
    out = open(Path(args.out) / f"stages{args.label}.jsonl", "a") if args.out else None
    gen = torch.Generator(device="cuda").manual_seed(2)
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",") if c]
    var_cases = [tuple(int(x) for x in c.split(":")) for c in args.variants.split(",") if c]
    width_cases = [tuple(int(x) for x in c.split(":")) for c in args.widths.split(",") if c]
    by_d = {}
    for d, k in cases + var_cases + width_cases:
        by_d.setdefault(d, set()).add(k)
    for d in sorted(by_d):
        offset = torch.randn(d, generator=gen, device="cuda") * 0.5
        Q, T = data(args.nq, d, gen, offset), data(args.nt, d, gen, offset)
        bias = (T * T).sum(1)
        gemm = statistics.median(cuda_ms(lambda: gemm_alone(Q, T, bias, "bf16"), args.reps))
        for k in sorted(by_d[d]):
            row = dict(label=args.label, d=d, k=k, nq=args.nq, nt=args.nt, gemm_bf16_ms=round(gemm, 1))
            if (d, k) in cases:
                if k == min(by_d[d]):
                    row.update(prepare_ms(Q, T, args.reps))
                row.update(stage_case(Q, T, k, args.reps, stages))
                row["over_gemm"] = round(row["search_ms"] / gemm, 2)
            if (d, k) in var_cases:
                row["variants"] = variants(Q, T, k, args.reps, [v for v in args.only.split(",") if v])
            if (d, k) in width_cases:
                row["widths"] = widths(Q, T, k, 2, stages)
            row["kernels"] = dict(stages.kernels)
            stages.kernels.clear()
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
        del Q, T, bias
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
