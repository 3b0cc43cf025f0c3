"""Every launch configuration the fused kernel's chooser can return fits the device.

:func:`nearest_kernels._triton_plan.plan_candidates` filters its configurations by its own
shared-memory estimate; on a device the compiled kernel's metadata has the last word
(``_triton_compile.load_refusal``). Here, with no GPU, the configurations are lowered for sm_80 and sm_90 by
Triton's own stages down to LLVM IR, where the shared-memory allocation is final
(``tests/kernels/_compile_target.py``), and their shared memory is checked against both limits (and against the estimate, which must not be below it, or the chooser
would offer configurations only the device check catches).

The shapes: d = 1..1536 (the common embedding sizes and odd ones), every candidate-list width
a search can ask for (k = 1, 10, 100 and the largest the fused kernel takes, widening rounds
included), bf16 / tf32 / fp32, many and few queries, targets enough for segments and too few.
The grid has hundreds of distinct configurations (a few seconds of compilation each): every
one is checked against the limits by its estimate, and only the configurations distinct in
shared memory are compiled: the most demanding one (largest estimate) of each target and
layout (single dot or d in chunks: 4 compilations), and the threshold filter's one launch
shape on sm_90, the only target it runs on (2 compilations: plain and lower keys). The
segmented mode is the row-list kernel with other list lengths (lists live in registers: it
compiles to the row-list mode's shared memory, byte for byte), so it is no group of its own;
per precision too took nine minutes on two cores, so not here. Where the targets are too few
for segments and the list too long for one register list, the chooser returns nothing: the
torch path runs (checked over the grid). Compiled kernels stay in Triton's cache (``TRITON_CACHE_DIR``,
by default ``~/.triton/cache``): a second run on the same machine only reads them back.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
triton = pytest.importorskip("triton", reason="triton is not installed")

from nearest_kernels import _gpu_bound as gb
from nearest_kernels import _triton_candidate_kernels as tkernels
from nearest_kernels import _triton_candidates as tcands
from nearest_kernels import _triton_filter as tfilter
from nearest_kernels import _triton_plan as tplan

DIMS = [1, 3, 17, 31, 33, 64, 96, 100, 128, 200, 256, 300, 384, 512, 768, 1024, 1536]
N_CANDS = [1 << e for e in range(3, 11)]          # 8 .. MAX_CANDIDATES
SHAPES = [(65_536, 1_000_000), (65_536, 63_681), (2_048, 60_000), (1, 20_000), (7, 300)]
PRECISIONS = ["bf16", "tf32", "fp32"]
TARGETS = {"sm_80": (tplan.SM80, 80), "sm_90": (tplan.SM90, 90)}


def _compiles():
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401

        from tests.kernels._compile_target import shared_bytes  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - depends on the triton build
        return f"triton cannot compile for a GPU target here ({type(exc).__name__}: {exc})"
    return None


def test_the_widths_cover_every_k_the_fused_kernel_takes():
    # k = 1, 10, 100 and the largest k each precision's first list allows, and each widening.
    for precision in PRECISIONS:
        for k in (1, 10, 100):
            n = gb.candidate_width(k, precision)
            while n <= tplan.MAX_CANDIDATES:
                assert n in N_CANDS
                n = gb.widened(n)


def plans_of_the_grid():
    """{(target, configuration key): (plan, d, precision, n_cand)} over the grid."""
    found = {}
    for name, (limits, _) in TARGETS.items():
        for precision in PRECISIONS:
            for d in DIMS:
                for n_cand in N_CANDS:
                    for m, nt in SHAPES:
                        plans = tplan.plan_candidates(m, nt, d, n_cand, precision, limits)
                        if not plans:   # the torch path: too few targets for segments
                            assert n_cand > tplan.ROWLIST_MAX, (name, d, n_cand, precision, m, nt)
                            assert tplan.segment_count(m, nt, n_cand, tplan.tile_config(n_cand, d, precision),
                                                       limits.sms) == 0, (name, d, n_cand, precision, m, nt)
                            continue
                        for plan in plans:
                            assert plan.shared_estimate <= limits.shared_bytes
                        plan = plans[0]
                        key = (name, precision, plan.config, plan.list_len, plan.block_d,
                               plan.single_dot, plan.t_desc, d % plan.block_d == 0,
                               plan.n_splits > 1 and not plan.segmented)
                        found.setdefault(key, (plan, d, precision, n_cand))
    return found


def test_every_shape_has_a_configuration_within_both_limits():
    found = plans_of_the_grid()
    assert {key[0] for key in found} == set(TARGETS)
    # The shape that crashed on the H200 (issue 20): bf16 at d=256 asked for 262,200 bytes.
    plan = tplan.plan_candidates(2_048, 60_000, 256, 16, "bf16", tplan.SM90)[0]
    assert plan.shared_estimate <= tplan.SM90.shared_bytes
    # No TMA below sm_90 (Triton would rewrite descriptors into a form never measured).
    assert not any(key[6] for key in found if key[0] == "sm_80")


def _arguments(plan, d, precision, n_cand):
    """A launch of ``plan`` on small CPU tensors of the right dtypes and alignment: the
    compiled kernel depends on them, not on the row counts (not specialised)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    dt = torch.bfloat16 if precision == "bf16" else torch.float32
    rows, nt = 256, 4096
    q = torch.zeros((rows, d), dtype=dt)
    t = torch.zeros((nt, d), dtype=dt)
    bias = torch.zeros(nt)
    level = torch.zeros(8, dtype=torch.int32)
    aligned = (d * t.element_size()) % 16 == 0
    t_arg = TensorDescriptor.from_tensor(t, [plan.config.block_n, plan.block_d]) if plan.t_desc and aligned else t
    out = torch.zeros((rows, plan.n_splits * plan.list_len), dtype=torch.int64)
    return tkernels.rowlist_kernel, tcands.rowlist_arguments(
        plan, q, t_arg, t, bias, out, bias, level, rows, nt, d, 2.0, 0, skip_test=True,
        lower=False, precision=precision, upcast=False)


def _check_compiled(entry, name):
    from tests.kernels._compile_target import shared_bytes

    plan, d, precision, n_cand = entry
    limits, arch = TARGETS[name]
    kernel, (_, args, kwargs) = _arguments(plan, d, precision, n_cand)
    shared = shared_bytes(kernel, args, kwargs, arch)
    where = f"{name} d={d} n_cand={n_cand} {precision} {plan.config} block_d={plan.block_d}"
    assert shared <= limits.shared_bytes, f"{where}: {shared} bytes of shared memory"
    if name == "sm_90":
        # On sm_80 (mma v2, cp.async) some forms compile to up to ~2x the estimate (within the
        # limit everywhere here); the device check (_triton_compile.load_refusal) covers them there.
        assert shared <= plan.shared_estimate, f"{where}: {shared} bytes, estimated {plan.shared_estimate}"


def _representative(found, by_precision: bool):
    """The configuration with the largest estimate per (target, layout), and per precision
    too with ``by_precision`` (the segmented mode is the row-list kernel: see the module notes)."""
    best = {}
    for key, entry in found.items():
        plan = entry[0]
        group = (key[0], key[1] if by_precision else "", plan.single_dot)
        if group not in best or entry[0].shared_estimate > best[group][1][0].shared_estimate:
            best[group] = (key, entry)
    return [pytest.param(entry, key[0], id=f"{key[0]}-{key[1]}-{entry[0].config.kernel}-"
                         f"{'single' if entry[0].single_dot else 'chunked'}-d{entry[1]}-n{entry[3]}")
            for key, entry in best.values()]


REASON = _compiles()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
@pytest.mark.parametrize("entry,name", _representative(plans_of_the_grid(), by_precision=False))
def test_the_most_demanding_configurations_compile_within_the_limits(entry, name):
    _check_compiled(entry, name)


def _filter_launch(lower: bool):
    """(args, kwargs) of the filter pass's launch at k = 100, d = 384 (two splits)."""
    rows, nt, d, splits = 256, 4096, 384, 2
    slots = tfilter.filter_slots(tfilter.filter_cap(512), splits)
    q = torch.zeros((rows, d), dtype=torch.bfloat16)
    t = torch.zeros((nt, d), dtype=torch.bfloat16)
    bias = torch.zeros(nt)
    level = torch.zeros(8, dtype=torch.int32)
    thr = torch.zeros(rows)
    count = torch.zeros((rows, splits * tkernels.FILTER_LANES), dtype=torch.int32)
    buf = torch.zeros((rows, splits * tkernels.FILTER_LANES * slots), dtype=torch.int64)
    _, args, kwargs = tfilter.filter_arguments(q, t, bias, level, thr, count, buf, rows, nt, d, 2.0, 0, slots,
                                               splits, lower=lower, upcast=False)
    return args, kwargs


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_the_filter_appends_run_in_a_layout_that_gives_each_row_to_one_quad():
    # The PTX appends count a row's hits in registers of the thread that holds them, one slice
    # of the row's buffer per lane of its quad (laneid & 3), two rows a thread told apart by
    # row % 16: right only if the appends, and the store of the counters after the loop, run in
    # the wgmma accumulator's layout with one warp per 16 rows (each row in the four lanes of
    # one quad). A Triton that chose otherwise would lose hits: this fails first.
    import re

    from tests.kernels._compile_target import ttgir

    text = ttgir(tkernels.filter_kernel, *_filter_launch(False), 90)
    mma = re.search(r"#mma = #ttg.nvidia_mma<\{versionMajor = 3, versionMinor = 0, warpsPerCTA = \[(\d+), (\d+)\], "
                    r"instrShape = \[(\d+),", text)
    assert mma and mma.groups() == (str(tfilter.FILTER_TILES.num_warps), "1", "16"), mma and mma.group(0)
    ops = [line for line in text.splitlines() if "tt.elementwise_inline_asm" in line]
    tiles = [line for line in ops if "%fk_c0, %fk_c1;" not in line]   # all but the counters' declaration
    assert len(ops) == 3 and len(tiles) == 2, len(ops)
    for line in tiles:
        assert line.rstrip().split("->")[-1].strip().startswith(
            f"tensor<{tfilter.FILTER_TILES.block_m}x{tfilter.FILTER_TILES.block_n}xi32, #mma>"), line[-200:]


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
@pytest.mark.parametrize("lower", [False, True], ids=["plain", "lower-keys"])
def test_the_threshold_filter_compiles_within_the_sm90_limit(lower):
    # The filter pass (gpu.filter_refusal: compute capability 9.x only) has one launch shape,
    # FILTER_TILES, with its appends as inline PTX: its shared memory is the operand stages'
    # alone, and it must leave the device's limit room whatever d (one compiled variant).
    from tests.kernels._compile_target import shared_bytes

    limits, arch = TARGETS["sm_90"]
    args, kwargs = _filter_launch(lower)
    shared = shared_bytes(tkernels.filter_kernel, args, kwargs, arch)
    tiles = tfilter.FILTER_TILES
    stages = (tiles.block_m + tiles.block_n) * tiles.block_d * 2 * tiles.num_stages
    assert stages <= shared <= limits.shared_bytes, (shared, stages, limits.shared_bytes)


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
@pytest.mark.parametrize("rows,nt", [(65_536, 63_681), (1, 200_000)], ids=["two-splits", "thin-slices"])
def test_a_long_lists_ranking_kernels_compile_within_the_sm90_limit(rows, nt):
    # A long list's head and rest kernels (one row of the filter's buffer in a program) and the
    # packed re-rank, with the launches of long_list_topk: the buffer of two splits (4,096
    # positions) and of the most splits (few query rows beside many targets: 16,384 positions,
    # the warps growing with them), both metrics' packing.
    from nearest_kernels import _triton_rerank as trerank
    from tests.kernels._compile_target import shared_bytes

    limits, arch = TARGETS["sm_90"]
    splits = tfilter.filter_splits(rows, nt, tfilter.FILTER_TILES, limits.sms)
    slots = tfilter.filter_slots(tfilter.filter_cap(2048), splits)
    slices = splits * tkernels.FILTER_LANES
    block_w = triton.next_power_of_2(slices * slots)
    assert block_w == (4096 if rows > 1 else 16_384)
    buf, count = torch.zeros((2, slices * slots), dtype=torch.int64), torch.zeros((2, slices), dtype=torch.int32)
    head, kth = torch.zeros((2, 1000), dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    limit, rest_n = torch.zeros(2), torch.zeros(2, dtype=torch.int32)
    shape = {"BLOCK_W": block_w, "num_warps": tfilter.hits_warps(block_w)}
    for kernel, args in ((tfilter.hits_head_kernel, (buf, count, head, kth, slices * slots, slices, slots, 1000)),
                         (tfilter.hits_rest_kernel, (buf, count, kth, limit, head, rest_n, slices * slots, slices,
                                                     slots, 1000, 1024))):
        assert shared_bytes(kernel, args, shape, arch) <= limits.shared_bytes, kernel
    d = 384
    for metric in ("cosine", "inner_product"):
        _, args, kwargs = trerank.rerank_arguments(
            torch.zeros((2, d)), torch.zeros((2, d)), torch.zeros(2, dtype=torch.float64),
            torch.zeros(2, dtype=torch.float64), torch.zeros(d, dtype=torch.float64), head,
            torch.zeros(2, dtype=torch.int32), torch.zeros((2, 1000), dtype=torch.int64), metric, packed=True)
        assert kwargs["PACKED"] == (1 if metric == "cosine" else 2)
        assert shared_bytes(trerank.rerank_kernel, args, kwargs, arch) <= limits.shared_bytes, metric
