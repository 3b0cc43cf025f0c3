"""GPU search at the k of recommenders (10, 100, 1000) on embedding-like data with and without groups
of identical rows (issue 46): the exact search (precision auto) against torch's fp32 ``mm`` + ``topk``
on the same tensors, checked against the float64 oracle on sampled rows, ties to the lower index.

The data (:func:`embeddings`) stands in for 63,681 MiniLM rows, about 6% of them in groups of
identical rows: ``plain`` without the groups, ``groups`` and ``contiguous`` with them.

    python benchmarks/gpu_large_k.py [--dims 384,768] [--ks 10,100,1000] [--sets plain,groups,contiguous] [--rounds]
    python benchmarks/gpu_large_k.py --queries 10000 --ks 1000    # 10,000 of the rows against the other 53,681
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._record import Recorder, cuda_ms  # noqa: E402
from benchmarks.gpu_shapes import addmm_topk, wrong_rows  # noqa: E402
from nearest_kernels.gpu import knn_torch, resolve_precision  # noqa: E402


def embeddings(n: int, d: int, gen, groups: bool, share: float = 0.06, centres: int = 300,
               sizes: tuple[int, int] = (10, 100), contiguous: bool = False, device: str = "cuda"):
    """``n`` float32 unit rows on the device: cluster centres plus noise (a common direction as
    real embeddings have), normalised; with ``groups``, rows at random positions replaced by
    copies of others so that about ``share`` of the rows lie in groups of ``sizes`` identical
    rows; ``contiguous``: each group's rows next to each other (a corpus that repeats a text in
    a row), at a random place; ``device``: where (``gen`` a generator there). Returns (rows,
    number of groups)."""
    common = torch.randn(d, generator=gen, device=device)
    c = torch.randn((centres, d), generator=gen, device=device) + common
    x = c[torch.randint(0, centres, (n,), generator=gen, device=device)]
    x = x + 0.8 * torch.randn((n, d), generator=gen, device=device)
    x = x / x.norm(dim=1, keepdim=True)
    n_groups = 0
    if groups:
        perm = torch.randperm(n, generator=gen, device=device)
        sizes_gen = torch.Generator().manual_seed(n)
        at, copies = 0, int(share * n)
        blocks = []
        while at < copies:
            g = int(torch.randint(sizes[0], sizes[1] + 1, (1,), generator=sizes_gen))
            rows = perm[at:at + g]
            x[rows] = x[rows[0]].clone()
            blocks.append(rows)
            at, n_groups = at + g, n_groups + 1
        if contiguous:   # each group one block, every other row a block of its own, shuffled
            blocks += list(perm[at:, None])
            order = torch.randperm(len(blocks), generator=sizes_gen).tolist()
            x = x[torch.cat([blocks[b] for b in order])]
    return x.contiguous(), n_groups


def tie_rule_violations(Q64, T64, idx, rows, k) -> int:
    """Sampled rows whose result holds the oracle's keys but not its indices: the same float64
    keys (so only exact ties were chosen differently) and not the lowest indices among them."""
    q = Q64[rows]
    keys = torch.empty((rows.numel(), T64.shape[0]), dtype=torch.float64, device="cuda")
    step = max(1, (1 << 27) // max(1, q.numel()))
    for c0 in range(0, T64.shape[0], step):
        diff = q[:, None, :] - T64[c0:c0 + step][None]
        keys[:, c0:c0 + step] = (diff * diff).sum(2)
    best = torch.sort(keys, dim=1, stable=True).indices[:, :k]   # (key, index) order
    got = idx[rows]
    same_keys = (torch.sort(keys.gather(1, got), dim=1).values == torch.sort(keys.gather(1, best), dim=1).values)
    same_idx = torch.sort(got, dim=1).values == torch.sort(best, dim=1).values
    return int((same_keys.all(1) & ~same_idx.all(1)).sum())


class RoundLog(logging.Handler):
    """The search's own DEBUG lines (first pass, rows widened and their widths, fallbacks), each
    with the milliseconds since the call began: the widening rounds' messages follow a host
    sync, so their times are the rounds' ends."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.start, self.lines = 0.0, []

    def emit(self, record):
        self.lines.append(f"{1e3 * (time.perf_counter() - self.start):7.1f} ms  {record.getMessage()}")


def traced(fn) -> list[str]:
    """One call of ``fn`` with the search's DEBUG lines captured (:class:`RoundLog`)."""
    log = logging.getLogger("nearest_kernels")
    handler, level = RoundLog(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    torch.cuda.synchronize()
    handler.start = time.perf_counter()
    try:
        fn()
        torch.cuda.synchronize()
        handler.lines.append(f"{1e3 * (time.perf_counter() - handler.start):7.1f} ms  done")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return handler.lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=63_681, help="rows of the self-join")
    ap.add_argument("--queries", type=int, default=0,
                    help="instead of the self-join: the first QUERIES rows against the others")
    ap.add_argument("--dims", default="384")
    ap.add_argument("--ks", default="10,100,1000")
    ap.add_argument("--metric", default="cosine", choices=["cosine", "l2"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sample", type=int, default=64, help="rows checked against the oracle")
    ap.add_argument("--sets", default="plain,groups,contiguous",
                    help="the stand-in without its groups, with them at random positions, each group's rows together")
    ap.add_argument("--rounds", action="store_true", help="print each search's rounds (its DEBUG lines)")
    ap.add_argument("--budget-s", type=float, default=400)
    args = ap.parse_args(argv)
    rec = Recorder("gpu_large_k", blas=False)
    auto = resolve_precision("auto", torch.device("cuda"))
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    start = time.time()
    for d in (int(x) for x in args.dims.split(",")):
        for name in args.sets.split(","):
            if name not in ("plain", "groups", "contiguous"):
                ap.error(f"--sets: expected plain, groups or contiguous, got {name!r}")
            gen = torch.Generator(device="cuda").manual_seed(d)
            X, n_groups = embeddings(args.n, d, gen, name != "plain", contiguous=name == "contiguous")
            # The oracle's rows (cosine: the float64 unit rows, ranked by their l2 distances).
            X64 = X.double() / X.double().norm(dim=1, keepdim=True) if args.metric == "cosine" else X.double()
            split = args.queries or None   # queries X[:split], targets X[split:] (None: all of X)
            Q, T, Q64, T64 = X[:split], X[split:] if split else X, X64[:split], X64[split:] if split else X64
            T64_host = T64.cpu().numpy()
            bias = (T * T).sum(1)
            rows = torch.linspace(0, Q.shape[0] - 1, args.sample, device="cuda").long()
            for k in (int(x) for x in args.ks.split(",")):
                if time.time() - start > args.budget_s:
                    print(f"budget spent: skipped d={d} {name} k={k}", flush=True)
                    continue

                def ours():
                    return knn_torch(Q, T, k, args.metric, "auto")

                row = dict(n=args.n, nq=Q.shape[0], nt=T.shape[0], d=d, set=name, k=k, metric=args.metric,
                           groups=n_groups, auto=auto, reps=args.reps)
                row["torch_fp32_mm_topk_ms"] = round(cuda_ms(lambda: addmm_topk(Q, T, bias, "fp32", k), args.reps), 1)
                v, idx = ours()
                if args.metric == "cosine":
                    v = torch.sqrt(torch.clamp(2.0 - 2.0 * v.double(), min=0.0))   # unit rows' l2
                row["exact_ms"] = round(cuda_ms(ours, args.reps), 1)
                row["exact_over_torch"] = round(row["exact_ms"] / row["torch_fp32_mm_topk_ms"], 2)
                row["wrong_of_sample"] = wrong_rows(Q64, T64, T64_host, k, idx, rows.numel(), v)
                row["tie_rule_wrong_of_sample"] = tie_rule_violations(Q64, T64, idx, rows, k)
                row["sample_rows"] = args.sample
                print(row, flush=True)
                rec.add("large_k" if split is None else "large_k_split", **row)
                if args.rounds:
                    print("\n".join("    " + line for line in traced(ours)), flush=True)
            del X, X64, Q, T, Q64, T64, T64_host
            torch.cuda.empty_cache()
    rec.print_tables()


if __name__ == "__main__":
    main()
