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
