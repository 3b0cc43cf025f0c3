"""Collect this folder only under the Triton interpreter.

``TRITON_INTERPRET`` is read when triton loads, so it cannot be switched on for some tests of
a process: the main run leaves these modules out and runs them all in one subprocess with the
variable set (tests/kernels/test_gpu.py::test_kernels_under_the_triton_interpreter).
"""
from __future__ import annotations

import importlib.util
import os

# (Without triton or torch the parent test skips with that reason and never starts the run.)
if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None \
        or importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import inspect

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    _apply_impl = interpreter.ReduceOps.apply_impl

    def _apply_impl_with_xor(self, input):
        """The interpreter reduces with any combine function other than min, max, argmin,
        argmax and sum one element at a time in Python (``ReduceOps.generic_reduce``), and
        ``tl.sort``'s bitonic network (the kernels' list merges) reduces with xor: that loop
        was most of this suite's time. numpy's xor reduce gives the same bits (xor of
        integers is exact and associative), the same shapes and the same dtype."""
        if self.combine_fn == tl.standard._xor_combine:
            data = input[0].handle.data
            out = np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims)
            return self.to_tensor(out if self.axis is not None or self.keep_dims else out.item(),
                                  input[0].dtype)
        return _apply_impl(self, input)

    interpreter.ReduceOps.apply_impl = _apply_impl_with_xor

    # The body of the interpreter's device-function call (a @triton.jit function called from a
    # kernel) that the shortcut below replays; another triton's runs as it ships.
    _DEVICE_CALL_SOURCE = """\
    def __call__(self, *args, **kwargs):
        # This is a device function call
        _patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise InterpreterError(repr(e)) from e
"""
    _device_call = interpreter.InterpretedFunction.__call__
    _grid_call = interpreter.GridExecutor.__call__
    # The language modules (triton.language, triton.language.core) that device-function calls
    # patched during the kernel run under way; None outside a run.
    _patched_in_run: set | None = None
    _langs_of: dict = {}

    def _grid_call_tracking(self, *args, **kwargs):
        global _patched_in_run
        outer, _patched_in_run = _patched_in_run, set()
        try:
            return _grid_call(self, *args, **kwargs)
        finally:
            _patched_in_run = outer

    def _device_call_patching_once(self, *args, **kwargs):
        """The interpreter patches the language modules a device function sees on every call
        (``_patch_lang``: ``inspect.getmembers`` over them, every builtin wrapped), and
        ``tl.sort``'s bitonic network (the kernels' list merges) calls small device functions
        thousands of times: that was about half of this suite's time. Within one kernel run
        nothing undoes a device call's patches (the kernel's own are restored when the run
        ends), so a second patch of the same modules only rebinds the same wrappers: this
        patches once per run and module set and otherwise does what the interpreter does."""
        langs = _langs_of.get(self.fn)
        if langs is None:
            langs = _langs_of[self.fn] = frozenset(
                id(value) for value in self.fn.__globals__.values() if value is tl or value is tl.core)
        if _patched_in_run is None or not langs <= _patched_in_run:
            interpreter._patch_lang(self.fn)
            if _patched_in_run is not None:
                _patched_in_run.update(langs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    if inspect.getsource(_device_call) == _DEVICE_CALL_SOURCE:
        interpreter.GridExecutor.__call__ = _grid_call_tracking
        interpreter.InterpretedFunction.__call__ = _device_call_patching_once
