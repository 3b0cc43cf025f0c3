"""The interpreter shortcuts that ``conftest.py`` here installs give what the interpreter's own
code gives: its fast xor reduce, in a kernel (xor sums along each axis and of the whole block,
kept dimensions too, and ``tl.sort``, which the kernels' list merges use and whose bitonic
network reduces with xor), and its device-function calls that patch the language once a run."""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from . import conftest


@triton.jit
def _xor_and_sort(x_ptr, rows_ptr, cols_ptr, kept_ptr, all_ptr, sorted_ptr, M: tl.constexpr, N: tl.constexpr):
    offs_m = tl.arange(0, M)
    offs_n = tl.arange(0, N)
    x = tl.load(x_ptr + offs_m[:, None] * N + offs_n[None, :])
    tl.store(rows_ptr + offs_m, tl.xor_sum(x, axis=1))
    tl.store(cols_ptr + offs_n, tl.xor_sum(x, axis=0))
    tl.store(kept_ptr + offs_m[:, None], tl.xor_sum(x, axis=1, keep_dims=True))
    tl.store(all_ptr, tl.xor_sum(x))
    tl.store(sorted_ptr + offs_m[:, None] * N + offs_n[None, :], tl.sort(x, dim=1))


def _run(x: torch.Tensor) -> list[torch.Tensor]:
    m, n = x.shape
    outs = [torch.empty(m, dtype=x.dtype), torch.empty(n, dtype=x.dtype), torch.empty(m, dtype=x.dtype),
            torch.empty(1, dtype=x.dtype), torch.empty_like(x)]
    _xor_and_sort[(1,)](x, *outs, M=m, N=n)
    return outs


def test_fast_xor_reduce_equals_the_interpreters_own(monkeypatch):
    # the interpreter's own method, kept by conftest before it installed the fast one
    assert conftest._apply_impl.__qualname__ == "ReduceOps.apply_impl"
    assert interpreter.ReduceOps.apply_impl is conftest._apply_impl_with_xor
    rng = np.random.default_rng(3)
    for dtype in (torch.int32, torch.int64):
        x = torch.from_numpy(rng.integers(-2**31, 2**31 - 1, (8, 16))).to(dtype)
        fast = _run(x)
        with monkeypatch.context() as patch:
            patch.setattr(interpreter.ReduceOps, "apply_impl", conftest._apply_impl)
            slow = _run(x)
        for a, b in zip(fast, slow):
            assert torch.equal(a, b)
        want = np.bitwise_xor.reduce(x.numpy(), axis=1)
        assert np.array_equal(fast[0].numpy(), want) and np.array_equal(fast[2].numpy(), want)
        assert int(fast[3][0]) == int(np.bitwise_xor.reduce(x.numpy(), axis=None))
        assert torch.equal(fast[4], torch.sort(x, dim=1).values)


@triton.jit
def _clamp_below(x, floor):
    return tl.where(x < floor, floor, x)


@triton.jit
def _nested_calls(x_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr):
    offs_m = tl.arange(0, M)
    offs_n = tl.arange(0, N)
    x = tl.load(x_ptr + offs_m[:, None] * N + offs_n[None, :])
    ranked = tl.sort(_clamp_below(x, 0), dim=1, descending=True)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], ranked)


def test_device_calls_patched_once_a_run_give_the_interpreters_results(monkeypatch):
    """conftest patches the language modules once per kernel run and module set instead of on
    every device-function call: a kernel of nested device calls (this module's and tl.sort's)
    gives what the interpreter's own call gives, run after run."""
    assert interpreter.InterpretedFunction.__call__ is conftest._device_call_patching_once
    assert interpreter.GridExecutor.__call__ is conftest._grid_call_tracking
    rng = np.random.default_rng(5)
    for _ in range(2):
        x = torch.from_numpy(rng.integers(-50, 50, (4, 16))).to(torch.int32)
        fast = torch.empty_like(x)
        _nested_calls[(1,)](x, fast, M=4, N=16)
        assert conftest._patched_in_run is None
        with monkeypatch.context() as patch:
            patch.setattr(interpreter.InterpretedFunction, "__call__", conftest._device_call)
            patch.setattr(interpreter.GridExecutor, "__call__", conftest._grid_call)
            slow = torch.empty_like(x)
            _nested_calls[(1,)](x, slow, M=4, N=16)
        assert torch.equal(fast, slow)
        assert torch.equal(fast, torch.sort(x.clamp(min=0), dim=1, descending=True).values)
