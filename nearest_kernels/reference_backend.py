"""Registers the float64 reference as a backend (always available, slowest, the oracle)."""
from __future__ import annotations

from ._common import Metric, check_cap
from .reference import knn_reference

# The backend's tolerance against the float64 difference-form oracle (``rtol`` of
# tests/oracle.py's assert_true_topk), relative to the size of the shifted problem: it ranks by
# float64 difference-form keys (the oracle's own form), whose rounding is ~d 2^-53 of that size,
# and rounds each value once to float32 (which the check allows for separately).
RTOL = 1e-12


class ReferenceBackend:
    name = "reference"
    devices = ("cpu",)
    dtypes = ("float32", "float64")
    metrics = ("l2", "sqeuclidean", "inner_product", "cosine")
    max_k = None
    caps = True     # takes knn's ``cap`` option

    def refuse(self, queries, targets, k, metric: Metric, **options) -> str | None:
        return None

    def run(self, queries, targets, k, metric: Metric, cap=None, **options):
        return knn_reference(queries, targets, k, metric, check_cap(cap))


BACKEND = ReferenceBackend()
