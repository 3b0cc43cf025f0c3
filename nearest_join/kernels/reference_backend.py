"""Registers the float64 reference as a backend (always available, slowest, the oracle)."""
from __future__ import annotations

from ._common import Metric
from .reference import knn_reference


class ReferenceBackend:
    name = "reference"
    devices = ("cpu",)
    dtypes = ("float32", "float64")
    metrics = ("l2", "sqeuclidean", "inner_product", "cosine")
    max_k = None

    def refuse(self, queries, targets, k, metric: Metric, **options) -> str | None:
        return None

    def run(self, queries, targets, k, metric: Metric, **options):
        return knn_reference(queries, targets, k, metric)


BACKEND = ReferenceBackend()
