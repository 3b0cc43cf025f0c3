"""Pure numeric kernels: exact top-k search of a query block against a target block.

Imports neither pyspark nor pandas. The public entry is :func:`knn`; :func:`merge_topk`
merges partial results of several target blocks and is shared by every plan.
"""
from ._common import METRICS, Metric, rankable_rows, resolve_metric, seeds_heaps
from ._numba import compile_lock, import_numba
from .dispatch import backend_names, choose_backend, get_backend, knn, register_backend
from .merge import merge_topk

__all__ = [
    "compile_lock",
    "import_numba",
    "knn",
    "merge_topk",
    "METRICS",
    "Metric",
    "resolve_metric",
    "rankable_rows",
    "seeds_heaps",
    "backend_names",
    "choose_backend",
    "get_backend",
    "register_backend",
]
