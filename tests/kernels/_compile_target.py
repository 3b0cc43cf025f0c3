"""Compile a Triton kernel for a GPU target without a GPU (triton ships ptxas).

:func:`compile_for` builds what ``kernel[grid](*args, **kwargs)`` would compile on a device of
``target`` (the JIT's own specialisation of the arguments: dtypes, 16-byte alignment of
pointers and integers, constexprs, num_warps, num_stages) and compiles it to a cubin, whose
metadata holds the shared memory a launch asks for.
"""
from __future__ import annotations

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

import triton


def target(arch: int) -> GPUTarget:
    return GPUTarget("cuda", arch, 32)


def compile_for(kernel, args, kwargs, arch: int):
    """The compiled kernel (``.metadata.shared``: bytes of shared memory) for ``arch``."""
    tgt = target(arch)
    backend = make_backend(tgt)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args,
                                                              specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=tgt,
                          options=options.__dict__)
