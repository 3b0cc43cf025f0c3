"""nearest_join: a fast, exact distributed nearest-neighbour join for Apache Spark.

``from nearest_join import nearest_by_join`` is the public entry (Spark's ``nearestByJoin``
contract). The Spark layer is imported lazily, on the first use of one of the names below, so
that ``import nearest_join`` itself costs nothing (the numeric kernels are a package of their
own, :mod:`nearest_kernels`, which never imports this one).
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "nearest_by_join": "nearest_join.join",
    "explain_nearest_join": "nearest_join.join",
    "incremental_nearest_join": "nearest_join.incremental",
    "explain_incremental": "nearest_join.incremental",
    "JoinPlan": "nearest_join.planner",
    "build_ivf_index": "nearest_join.ivf_index",
    "IVFIndex": "nearest_join.ivf_index",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nearest_join' has no attribute {name!r}")
