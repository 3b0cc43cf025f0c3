"""Tests of the fused Triton kernels that run under the Triton interpreter (``TRITON_INTERPRET=1``
on the CPU). Importing this package patches the interpreter for triton 3.6 with numpy >= 2.4:
its scalar arguments are 1-element arrays, which numpy no longer converts with ``int()``, so
they are given an ``__index__`` that reads the element."""
from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton.runtime.interpreter as _interp
    except ImportError:  # the tests here skip (conftest.py) when triton is missing
        _interp = None
    if _interp is not None and not getattr(_interp, "_nearest_join_index_patch", False):
        _patch = _interp._patch_lang_tensor

        def _patched(tensor, scope):
            _patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patched
        _interp._nearest_join_index_patch = True
