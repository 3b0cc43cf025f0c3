"""Compile the register-list kernel for sm_90 here (no GPU needed) and report its resources.

    python benchmarks/kernel_sass.py                       # N_CAND 32 and 64, bf16, 128 x 128, 8 warps
    python benchmarks/kernel_sass.py --n-cand 16 --precision tf32 --stages 2 --sass out/
    python benchmarks/kernel_sass.py --strided             # as the segmented mode (k=100) runs it
    python benchmarks/kernel_sass.py --n-cand 16 --block-m 64 --warps 4 --tma   # bf16 k=10 as launched

Compiles ``_rowlist_kernel`` with the launch's constexprs and divisibility attributes (as
``triton_candidates`` launches it at d=128: without them the compiler assumes unaligned
pointers and strides and the figures differ, see benchmarks/gpu_notes.md version 3), then
reads registers, stack and local memory with triton's bundled ``cuobjdump`` and counts
spill loads/stores (LDL/STL), wgmma (HGMMA), asynchronous copies (LDGSTS) and TMA copies
(UTMALDG) in the SASS.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nearest_kernels import _gpu_triton as tr  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_rowlist(n_cand: int, precision: str, block_m: int, num_warps: int, num_stages: int,
                    extra_passes: int, d: int, strided: bool = False,
                    levels: bool = False, skip_test: bool = True, tma: bool = False):
    fn = tr._rowlist_kernel
    dtype = "bf16" if precision == "bf16" else "fp32"
    operand = "*" + dtype
    target = f"tensordesc<{dtype}[{tr.BLOCK_N}, {d}]>" if tma else operand
    signature = {"q_ptr": operand, "t_ptr": target, "bias_ptr": "*fp32", "out_ptr": "*i64",
                 "seed_ptr": "*fp32", "level_ptr": "*i32",
                 "nq": "i32", "nt": "i32", "d": "i32", "tiles_per_split": "i32",
                 "stride_q": "i32", "stride_t": "i32", "alpha": "fp32", "stride_level": "i32"}
    constants = dict(N_CAND=n_cand, BLOCK_M=block_m, BLOCK_N=tr.BLOCK_N, BLOCK_D=d,
                     EXTRA_PASSES=extra_passes, SINGLE_DOT=True,
                     INPUT_PRECISION="ieee" if precision == "fp32" else "tf32",
                     DOT_UPCAST=False, EVEN_D=True, STRIDED=strided,
                     LEVELS=levels, SKIP_TEST=skip_test, T_DESC=tma)
    signature.update({name: "constexpr" for name in constants})
    # 16-byte aligned pointers, d and the row strides multiples of 16 (d=128 contiguous rows);
    # nq, nt and tiles_per_split are never specialised (do_not_specialize).
    # (A tensor descriptor carries its own alignment: TMA requires 16 bytes.)
    aligned = (("q_ptr", "bias_ptr", "out_ptr", "d", "stride_q", "stride_t", "stride_level")
               + (() if tma else ("t_ptr",)))
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = ASTSource(fn, signature, constants, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-cand", default="32,64", help="comma-separated list lengths")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--extra-passes", type=int, default=3)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--strided", action="store_true", help="the segmented mode's strided tiles")
    ap.add_argument("--levels", action="store_true", help="bias table rows per program (EXACT mode lower keys)")
    ap.add_argument("--no-skip-test", action="store_true", help="without the row-minimum test (SKIP_TEST)")
    ap.add_argument("--tma", action="store_true", help="target tiles by tensor descriptor (T_DESC)")
    ap.add_argument("--sass", default=None, help="folder to write the SASS listings to")
    args = ap.parse_args(argv)
    print("| N_CAND | precision | BLOCK_M | warps | stages | registers | stack B | LDL | STL | HGMMA "
          "| LDGSTS | UTMALDG |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n_cand in (int(x) for x in args.n_cand.split(",")):
        kernel = compile_rowlist(n_cand, args.precision, args.block_m, args.warps, args.stages,
                                 args.extra_passes, args.d, args.strided,
                                 args.levels, not args.no_skip_test, args.tma)
        with tempfile.TemporaryDirectory() as tmp:
            cubin = os.path.join(tmp, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(kernel.asm["cubin"])
            usage = subprocess.run([BIN / "cuobjdump", "--dump-resource-usage", cubin],
                                   capture_output=True, text=True, check=True).stdout
            sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin],
                                  capture_output=True, text=True, check=True).stdout
        regs = re.search(r"REG:(\d+)", usage)
        stack = re.search(r"STACK:(\d+)", usage)
        # Opcodes with or without suffixes (LDL.LU, HGMMA.64x128x16.F32.BF16).
        counts = {op: len(re.findall(rf"\b{op}(?:\.\w+)*\s", sass))
                  for op in ("LDL", "STL", "HGMMA", "LDGSTS", "UTMALDG")}
        print(f"| {n_cand} | {args.precision} | {args.block_m} | {args.warps} | {args.stages} | "
              f"{regs.group(1) if regs else '?'} | {stack.group(1) if stack else '?'} | "
              f"{counts['LDL']} | {counts['STL']} | {counts['HGMMA']} | {counts['LDGSTS']} | "
              f"{counts['UTMALDG']} |")
        if args.sass:
            Path(args.sass).mkdir(parents=True, exist_ok=True)
            name = f"rowlist_{n_cand}_{args.precision}_m{args.block_m}_w{args.warps}{'_tma' if args.tma else ''}"
            Path(args.sass, f"{name}.sass").write_text(sass)


if __name__ == "__main__":
    main()
