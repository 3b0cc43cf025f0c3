"""Instrument (issue 46, no GPU needed): which share of sampled query rows one candidate list
proves, per precision, k and list width, on gpu_large_k's stand-in: the torch generator's list
(``_gpu_search.torch_candidates``), the re-rank and the proof of ``exact_topk``'s first round,
on CPU tensors (the keys, the bound and the proof are the same arithmetic as on the GPU).

    python benchmarks/gpu_large_k_proofs.py [--set plain|groups] [--rows 256]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.gpu_large_k import embeddings  # noqa: E402
from nearest_kernels import _gpu_search as gs  # noqa: E402
from nearest_kernels._gpu_bound import key_error_bound, lower_key_bound, margin_holds, value_limit  # noqa: E402
from nearest_kernels.gpu import prepare_queries, prepare_targets  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="plain", choices=["plain", "groups"])
    ap.add_argument("--rows", type=int, default=256, help="sampled query rows")
    ap.add_argument("--n", type=int, default=63_681)
    ap.add_argument("--d", type=int, default=384)
    args = ap.parse_args(argv)
    X, _ = embeddings(args.n, args.d, torch.Generator().manual_seed(args.d), args.set == "groups", device="cpu")
    Q = X[torch.linspace(0, args.n - 1, args.rows).long()]
    print("precision lower k width proven bound_median keygap_median")
    for precision in ("bf16", "tf32", "fp32"):
        prepared = prepare_targets(X, "cosine", precision)
        side = prepare_queries(Q, prepared.side)
        for k in (100, 1000):
            for lower in (False, True) if precision == "bf16" else (False,):
                for width in (1024, 2048, 4096):
                    keys, idx = gs.torch_candidates(side, prepared.side, width, lower=lower)
                    bound = (lower_key_bound if lower else key_error_bound)(side, prepared.stats, "cosine")
                    v, _ = gs.rerank(side, prepared.side, keys, idx, bound, k, None)
                    floor = keys[:, -1]
                    ok = floor > value_limit(v[:, k - 1], bound, side)
                    if not lower:
                        ok |= margin_holds(keys, bound, k, floor)
                    print(precision, lower, k, width, f"{float(ok.float().mean()):.3f}",
                          f"{float(bound.median()):.2e}", f"{float((floor - keys[:, k - 1]).median()):.2e}", flush=True)


if __name__ == "__main__":
    main()
