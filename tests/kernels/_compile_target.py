"""The shared memory a Triton kernel's launch asks for on a GPU target, without a GPU.

:func:`shared_bytes` builds what ``kernel[grid](*args, **kwargs)`` would compile on a device of
``target`` (the JIT's own specialisation of the arguments: dtypes, 16-byte alignment of
pointers and integers, constexprs, num_warps, num_stages) and runs Triton's stages for that
target down to LLVM IR: the shared-memory allocation is done there and recorded in the
metadata (``shared``, what a launch asks for); the later stages (PTX, then ptxas to a cubin,
most of the time on sm_80) do not change it. :func:`ttgir` stops where the layouts are chosen.
The result of :func:`shared_bytes` is kept in Triton's cache under the
compilation's own key, so a second run on the same machine only reads it back.
"""
from __future__ import annotations

import hashlib
import json

from triton._C.libtriton import get_cache_invalidating_env_vars, ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler.compiler import get_cache_key
from triton.runtime.cache import get_cache_manager
from triton.runtime.jit import create_function_from_signature

from triton import __version__

FILE = "shared_memory.json"


def target(arch: int) -> GPUTarget:
    return GPUTarget("cuda", arch, 32)


def _source(kernel, args, kwargs, tgt):
    """(backend, source, options) of what the JIT would compile for these arguments."""
    backend = make_backend(tgt)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args,
                                                              specialization, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    options = backend.parse_options(dict(options.__dict__, **src.parse_options()))
    return backend, src, options


def _lowered(backend, src, options, tgt, last: str, metadata: dict):
    stages = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(tgt, options, backend.get_codegen_implementation(options),
                         backend.get_module_map(), context)
    names = list(stages)
    for name in names[names.index(src.ext):names.index(last) + 1]:
        module = stages[name](module, metadata)
    return module


def ttgir(kernel, args, kwargs, arch: int) -> str:
    """The Triton GPU IR (layouts chosen) ``kernel`` compiles to on ``arch`` with these arguments."""
    tgt = target(arch)
    backend, src, options = _source(kernel, args, kwargs, tgt)
    metadata = {"hash": "", "target": tgt, **options.__dict__, **get_cache_invalidating_env_vars(),
                "triton_version": __version__}
    return str(_lowered(backend, src, options, tgt, "ttgir", metadata))


def shared_bytes(kernel, args, kwargs, arch: int) -> int:
    """Bytes of shared memory ``kernel`` asks for on ``arch`` with these arguments."""
    tgt = target(arch)
    backend, src, options = _source(kernel, args, kwargs, tgt)
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    cache = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest())
    kept = cache.get_file(FILE)
    if kept is not None:
        with open(kept) as f:
            return json.load(f)["shared"]
    metadata = {"hash": "", "target": tgt, **options.__dict__, **get_cache_invalidating_env_vars(),
                "triton_version": __version__}
    _lowered(backend, src, options, tgt, "llir", metadata)
    shared = int(metadata["shared"])
    cache.put(json.dumps({"shared": shared}), FILE, binary=False)
    return shared
