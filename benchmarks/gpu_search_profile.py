"""Where one library search's time goes: ``knn_torch`` at 65,536 x 10^6 (issue 20's shapes),
stage by stage, against the bf16 GEMM alone.

Per (d, k): the GEMM alone and the search (medians, CUDA events, as ``gpu_shapes.py``), then one
search with its stages timed apart (the library's functions wrapped: the device synchronised
before and after each, so each stage's time is its own, host work included; nested stages are
reported exclusive of the stages inside them) and one search under ``torch.profiler`` (device
time per kernel name). Counts: the filter's hits per row (mean, quantiles, max, overflows),
the pairs the re-rank computes (live candidates per row, per call of the values kernel), and
the rows that widen.

``--variants NAME,...``: after the library's own search, the same shapes with one of
:data:`VARIANTS` patched in (timed and staged, no profiler): candidates for the library, each
measured here before it replaces a default there.

Data as ``gpu_shapes.py`` (Gaussian rows with a per-dimension offset, l2). Run on a CUDA
machine: ``python3 benchmarks/gpu_search_profile.py [--dims 384,768,1536] [--ks 10,100]
[--variants stages4,...] [--variant-shapes 1536:10,384:100] [--budget-s 400] [--out DIR]``.
Prints JSON lines (and writes them to ``DIR/profile.jsonl``); records nothing in RESULTS.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_kernel import cuda_ms, gemm_alone  # noqa: E402
from gpu_shapes import data  # noqa: E402

from nearest_kernels import _gpu_torch as gt  # noqa: E402
from nearest_kernels import _gpu_triton as tr  # noqa: E402
from nearest_kernels import gpu  # noqa: E402

# (module, function name): the stages timed apart. Functions the library imports at call time
# (``from ._gpu_triton import ...`` inside ``search_prepared``) are patched on their module.
STAGES = [(gpu, "prepare_targets"), (gpu, "prepare_queries"), (gt, "prepare_queries"),
          (gt, "lower_bias_table"), (tr, "lower_bias_table"), (tr, "filter_threshold"), (tr, "sample_seed"),
          (tr, "filter_candidates"), (tr, "filter_select"), (tr, "triton_candidates"),
          (gt, "torch_candidates"), (gt, "rerank"), (tr, "triton_exact_values"), (gt, "rank_exact"),
          (gt, "lower_key_bound"), (gt, "key_error_bound"), (gt, "drop_beyond_cap")]


class StageClock:
    """Exclusive seconds per stage name, while ``on``."""

    def __init__(self):
        self.on = False
        self.seconds = collections.Counter()
        self.stack = []
        self.counts = collections.defaultdict(list)

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.synchronize()
                total = time.perf_counter() - t0
                inner = self.stack.pop()
                self.seconds[name] += total - inner
                if self.stack:
                    self.stack[-1] += total
        return timed


def install(clock: StageClock):
    for module, name in STAGES:
        fn = getattr(module, name)
        setattr(module, name, clock.wrap(f"{module.__name__.rsplit('.', 1)[-1]}.{name}", fn))
    select = tr.filter_select

    def count_hits(count, buf, n_cand):
        # count (rows, slices): a row's hits are its slices' together; it overflows where a slice does
        slots = buf.shape[1] // count.shape[1]
        c = count.sum(dim=1).double()
        q = torch.quantile(c[: min(c.numel(), 1 << 16)], torch.tensor([0.01, 0.5, 0.99], device=c.device,
                                                                      dtype=torch.float64))
        clock.counts["hits"].append(dict(mean=round(float(c.mean()), 1), p01=float(q[0]), p50=float(q[1]),
                                         p99=float(q[2]), max=int(c.max()), cap=buf.shape[1],
                                         slice_max=int(count.max()), slots=slots,
                                         overflow=int((count > slots).any(dim=1).sum()),
                                         below_list=int((c < n_cand).sum())))
    count_hits = clock.wrap("(counting)", count_hits)

    def counted_select(count, buf, threshold, n_cand):
        if clock.on:
            count_hits(count, buf, n_cand)
        return select(count, buf, threshold, n_cand)
    tr.filter_select = counted_select
    values = tr.triton_exact_values

    def count_values(idx):
        live = (idx >= 0).sum(dim=1).double()
        clock.counts["values"].append(dict(rows=idx.shape[0], width=idx.shape[1],
                                           live_mean=round(float(live.mean()), 1),
                                           live_max=int(live.max()) if live.numel() else 0))
    count_values = clock.wrap("(counting)", count_values)

    def counted_values(queries, targets, idx):
        if clock.on:
            count_values(idx)
        return values(queries, targets, idx)
    tr.triton_exact_values = counted_values


def _tiles(**changes):
    """A patch: the filter pass with other tiles."""
    def apply(patches):
        tiles = tr.FilterTiles(**changes)
        filter_candidates = tr.filter_candidates

        def with_tiles(*args, **kwargs):
            kwargs.setdefault("tiles", tiles)
            return filter_candidates(*args, **kwargs)
        patches.append((tr, "filter_candidates", with_tiles))
    return apply


def _sample(short, long):
    """A patch: the filter's (step, j) for lists up to 64 and beyond."""
    def apply(patches):
        patches.append((tr, "filter_sample", lambda n_cand: short if n_cand <= 64 else long))
    return apply


def _torch_queries(patches):
    """A patch: the queries prepared by the torch form (``_gpu_torch.prepare_queries``)."""
    patches.append((gpu, "prepare_queries", lambda queries, targets: gt.prepare_queries(queries, targets)))


def _narrow(divisor):
    """A patch: the filter's first list of a sampled width (k >= 64) ``divisor`` times narrower."""
    def apply(patches):
        width = gpu.first_list_width

        def narrower(k, precision, d):
            w = width(k, precision, d)
            return w // divisor if gpu.sampled_first_pass(k, precision, d) else w
        patches.append((gpu, "first_list_width", narrower))
    return apply


def _select_f32(patches):
    """A patch: the filter's selection by a radix ``topk`` over the float32 keys (half the
    digit passes of the packed int64), the n_cand + 1 chosen then sorted by their packed
    entries (key, then index). Exact: the entries left out have keys at least the largest
    chosen, which is the cut."""
    import math

    library = tr.filter_select

    def select(count, buf, threshold, n_cand):
        rows, cap = buf.shape
        width = min(cap, max(1, int(count.max())))
        slots = torch.arange(width, device=buf.device)
        live = slots[None, :] < count[:, None]
        packed = torch.where(live, buf[:, :width], tr.EMPTY)
        if width <= n_cand:
            return library(count, buf, threshold, n_cand)
        mono = (packed >> 32).to(torch.int32)
        keys = (mono ^ ((mono >> 31) & 0x7FFFFFFF)).view(torch.float32)
        chosen = torch.topk(keys, n_cand + 1, dim=1, largest=False, sorted=False).indices
        top = torch.sort(torch.gather(packed, 1, chosen), dim=1).values
        lists, cut = top[:, :n_cand], tr.unpack(top[:, n_cand])[0]
        keys, idx = tr.unpack(lists)
        above = torch.nextafter(threshold, torch.full_like(threshold, math.inf))
        floor = torch.where(count > cap, -math.inf, torch.minimum(above, cut))
        return keys, idx, floor
    patches.append((tr, "filter_select", select))


def _rank_packed(patches):
    """A patch: the ranking's order by one sort of packed (value's order bits, index) int64
    instead of an index sort and a stable value sort."""
    import math

    def best_order(values, idx, k, descending):
        key = torch.where(idx >= 0, -values if descending else values, math.inf)
        bits = key.view(torch.int32)
        mono = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)
        packed = (mono << 32) | torch.where(idx >= 0, idx, 0x7FFFFFFF)
        return torch.sort(packed, dim=1).indices[:, : min(k, idx.shape[1])]
    patches.append((gt, "best_order", best_order))


def _both(*applies):
    def apply(patches):
        for a in applies:
            a(patches)
    return apply


# name -> patch(list of (module, attribute, value) to set)
VARIANTS = {
    "torch_queries": _torch_queries,
    "list256": _narrow(2),
    "list256_j16": _both(_narrow(2), _sample((32, 5), (32, 16))),
    "select_f32": _select_f32,
    "rank_packed": _rank_packed,
    "both_sorts": _both(_select_f32, _rank_packed),
    "stages4": _tiles(num_stages=4),
    "bd128": _tiles(block_d=128, num_stages=2),
    "sample_sparse": _sample((32, 5), (64, 10)),
    "sample32": _sample((32, 5), (32, 20)),
    "sample16": _sample((16, 10), (32, 20)),
    "long_j10": _sample((32, 5), (32, 10)),
    "long_j13": _sample((32, 5), (32, 13)),
    "long_j16": _sample((32, 5), (32, 16)),
}


@contextlib.contextmanager
def patched(name):
    patches = []
    if name != "default":
        VARIANTS[name](patches)
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in patches]
    for module, attr, value in patches:
        setattr(module, attr, value)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


class WidenLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        msg = record.getMessage()
        if "widen" in msg or "switch" in msg or "torch path" in msg or "first pass" in msg:
            self.lines.append(msg)


def kernel_table(fn, top: int = 14) -> list:
    """(kernel name, device ms) of one call of ``fn``, largest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:70]] += ev.device_time_total / 1000
    total = sum(per.values())
    rows = [(name, round(ms, 2)) for name, ms in per.most_common(top)]
    rows.append(("(all kernels)", round(total, 2)))
    return rows


def measure(Q, T, d, k, gemm, args, clock, widen, profiler: bool) -> dict:
    row = dict(d=d, k=k, nq=Q.shape[0], nt=T.shape[0], gemm_ms=round(gemm, 1))
    search = lambda: gpu.knn_torch(Q, T, k, "l2", "auto")  # noqa: E731
    row["search_ms"] = round(statistics.median(cuda_ms(search, args.reps)), 1)
    row["ratio"] = round(row["search_ms"] / gemm, 3)
    clock.seconds.clear()
    clock.counts.clear()
    widen.lines.clear()
    clock.on = True
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    search()
    torch.cuda.synchronize()
    row["staged_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    clock.on = False
    stages = {name: round(s * 1e3, 1) for name, s in clock.seconds.most_common()}
    stages["(rest)"] = round(row["staged_ms"] - sum(stages.values()), 1)
    row["stages_ms"] = stages
    row["stages_over_gemm"] = {name: round(ms / gemm, 3) for name, ms in stages.items()}
    row["counts"] = dict(clock.counts)
    row["log"] = widen.lines[:8]
    if profiler:
        row["kernels_ms"] = kernel_table(search)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="384,768,1536")
    ap.add_argument("--ks", default="10,100")
    ap.add_argument("--nq", type=int, default=65_536)
    ap.add_argument("--nt", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--no-profiler", action="store_true")
    ap.add_argument("--variants", default="")
    ap.add_argument("--variant-shapes", default="1536:10,1536:100,384:100",
                    help="d:k pairs the variants run at")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    clock = StageClock()
    install(clock)
    widen = WidenLog()
    for name in ("nearest_kernels._gpu_torch", "nearest_kernels.gpu"):
        logging.getLogger(name).addHandler(widen)
        logging.getLogger(name).setLevel(logging.DEBUG)
    out = Path(args.out) / "profile.jsonl" if args.out else None
    variants = [v for v in args.variants.split(",") if v]
    variant_shapes = {tuple(int(x) for x in pair.split(":")) for pair in args.variant_shapes.split(",") if pair}
    gen = torch.Generator(device="cuda").manual_seed(2)
    start = time.time()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for d in [int(x) for x in args.dims.split(",")]:
        offset = torch.randn(d, generator=gen, device="cuda") * 0.5
        T = data(args.nt, d, gen, offset)
        Q = data(args.nq, d, gen, offset)
        bias = (T * T).sum(1)
        gemm = statistics.median(cuda_ms(lambda: gemm_alone(Q, T, bias, "bf16"), args.reps))
        for k in [int(x) for x in args.ks.split(",")]:
            for variant in ["default"] + [v for v in variants if (d, k) in variant_shapes]:
                if time.time() - start > args.budget_s:
                    print(f"budget spent: skipped d={d} k={k} {variant}", flush=True)
                    continue
                with patched(variant):
                    row = measure(Q, T, d, k, gemm, args, clock, widen, profiler=(variant == "default"
                                                                                  and not args.no_profiler))
                row["variant"] = variant
                line = json.dumps(row)
                print(line, flush=True)
                if out:
                    with out.open("a") as fh:
                        fh.write(line + "\n")
        del Q, T, bias
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
