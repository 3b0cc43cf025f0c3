"""Backend registry and the one dispatcher behind :func:`nearest_kernels.knn`.

Each backend states what it supports (devices, dtypes, metrics, largest k) and can say why it
refuses an input; ``backend="auto"`` takes the first backend, in preference order, that
accepts the call, and when every backend refuses the error lists every reason (the shape of
xformers' ``ops/fmha/dispatch.py``). Backends are imported lazily so that a missing optional
dependency (numba, torch, triton) never breaks ``import nearest_kernels``.
"""
from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ._common import Metric, check_inputs, empty_result, rankable_rows, resolve_metric

logger = logging.getLogger(__name__)


class Backend(Protocol):
    """What a backend module exposes as ``BACKEND``.

    ``run`` receives only rows that can rank (finite, non-zero for cosine), at least one query
    and one target, and must return float32 values and int64 indices of shape (nq, k), best
    first, ties to the lower index, -1 / worst value in slots beyond the number of targets.
    """

    name: str
    devices: tuple[str, ...]
    dtypes: tuple[str, ...]
    metrics: tuple[str, ...]
    max_k: int | None
    caps: bool          # takes knn's ``cap`` option (else the dispatcher refuses a capped call)

    def refuse(self, queries: np.ndarray, targets: np.ndarray, k: int, metric: Metric,
               **options) -> str | None:
        """None when the backend accepts the call, else a one-line reason."""

    def run(self, queries: np.ndarray, targets: np.ndarray, k: int, metric: Metric,
            **options) -> tuple[np.ndarray, np.ndarray]:
        """Compute the top-k."""


@dataclass
class _Entry:
    name: str
    module: str
    loaded: Backend | None = None
    import_error: str | None = None
    tried: bool = field(default=False, repr=False)
    # One thread imports the backend while the others that ask for it wait: one that found it
    # tried while the import was under way would take it for unusable (a driver searches
    # beside its kernel warm-up thread).
    loading: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


# Preference order for backend="auto": fastest first, the float64 oracle last.
_REGISTRY: dict[str, _Entry] = {
    "gpu": _Entry("gpu", "nearest_kernels.gpu"),
    "cpu": _Entry("cpu", "nearest_kernels.cpu"),
    "reference": _Entry("reference", "nearest_kernels.reference_backend"),
}


def register_backend(name: str, module: str, *, before: str | None = None) -> None:
    """Register a backend module exposing ``BACKEND``; ``before`` sets its auto preference."""
    entry = _Entry(name, module)
    items = [(n, e) for n, e in _REGISTRY.items() if n != name]
    position = next((i for i, (n, _) in enumerate(items) if n == before), len(items))
    items.insert(position, (name, entry))
    _REGISTRY.clear()
    _REGISTRY.update(items)


def backend_names() -> list[str]:
    """All registered backend names in auto-preference order."""
    return list(_REGISTRY)


def _load(entry: _Entry) -> Backend | None:
    with entry.loading:
        if not entry.tried:
            try:
                entry.loaded = importlib.import_module(entry.module).BACKEND
            except Exception as exc:  # an optional dependency is missing or broken
                entry.import_error = f"cannot be imported ({type(exc).__name__}: {exc})"
                logger.debug("backend %s unavailable: %s", entry.name, entry.import_error)
            entry.tried = True
        return entry.loaded


def get_backend(name: str) -> Backend:
    """The backend called ``name``; ValueError for an unknown name, RuntimeError if unusable."""
    if name not in _REGISTRY:
        raise ValueError(f"backend: expected one of {['auto', *_REGISTRY]}, got {name!r}")
    entry = _REGISTRY[name]
    backend = _load(entry)
    if backend is None:
        raise RuntimeError(f"backend {name!r} {entry.import_error}")
    return backend


def _refusal(candidate: Backend, queries, targets, k: int, metric: Metric, **options) -> str | None:
    """Why ``candidate`` cannot run this call, or None. A ``cap`` needs a backend that
    declares ``caps`` (it prunes with the cap; ignoring it would return rows beyond it)."""
    if options.get("cap") is not None and not getattr(candidate, "caps", False):
        return "does not take a distance cap (max_distance / min_similarity)"
    return candidate.refuse(queries, targets, k, metric, **options)


def choose_backend(queries, targets, k: int, metric: Metric, backend: str = "auto",
                   **options) -> Backend:
    """The backend that will run this call; every refusal reason if none will."""
    if backend != "auto":
        chosen = get_backend(backend)
        reason = _refusal(chosen, queries, targets, k, metric, **options)
        if reason:
            raise ValueError(f"backend {backend!r} refuses this input: {reason}")
        return chosen
    reasons = []
    for name, entry in _REGISTRY.items():
        candidate = _load(entry)
        if candidate is None:
            reasons.append(f"{name}: {entry.import_error}")
            continue
        reason = _refusal(candidate, queries, targets, k, metric, **options)
        if reason is None:
            return candidate
        reasons.append(f"{name}: {reason}")
    raise ValueError("no backend accepts this input:\n  " + "\n  ".join(reasons))


def choose_task_backend(backend: str = "auto", *, skip: dict[str, str] | None = None
                        ) -> tuple[str, list[str]]:
    """(backend name, reasons of the backends refused before it) for an executor task,
    before it has data: the first backend in preference order that loads and whose
    ``refuse_task()`` (where it has one: devices, drivers) says nothing. ``skip``: backends the
    caller knows cannot run here, with the reason (the executor's cheap probe for a GPU, which
    spares a CPU executor the import of torch). A named backend is returned as it is: its own
    errors name why it cannot run.
    """
    if backend != "auto":
        if backend not in _REGISTRY:
            raise ValueError(f"backend: expected one of {['auto', *_REGISTRY]}, got {backend!r}")
        return backend, []
    reasons = []
    for name, entry in _REGISTRY.items():
        if skip and name in skip:
            reasons.append(f"{name}: {skip[name]}")
            continue
        candidate = _load(entry)
        if candidate is None:
            reasons.append(f"{name}: {entry.import_error}")
            continue
        refuse_task = getattr(candidate, "refuse_task", None)
        reason = refuse_task() if refuse_task is not None else None
        if reason is None:
            return name, reasons
        reasons.append(f"{name}: {reason}")
    raise ValueError("no backend can run on this executor:\n  " + "\n  ".join(reasons))


def knn(queries, targets, k: int, metric: str = "l2", backend: str = "auto", **options):
    """Exact k nearest targets of every query row, without the full distance matrix.

    Parameters
    ----------
    queries : ndarray (nq, d), float32 or float64
    targets : ndarray (nt, d), float32 or float64, same d
    k : int >= 1
    metric : {"l2", "sqeuclidean", "inner_product", "cosine"}
        ``l2`` is Euclidean distance (Spark's ``vector_l2_distance``), ``sqeuclidean`` its
        square; both rank smallest first. ``inner_product`` and ``cosine`` are similarities
        (Spark's ``vector_inner_product`` / ``vector_cosine_similarity``), largest first.
    backend : {"auto", "gpu", "cpu", "reference"}
        ``auto`` picks the first backend in :func:`backend_names` order that accepts the input.
    **options
        Passed to the backend: ``threads`` (CPU threads, default: this process's share of
        cores), ``precision`` (GPU: "auto", the default: bf16 on compute capability >= 8.0,
        else fp32; or "fp32", "tf32", "bf16"), ``device`` (GPU ordinal), ``cap`` (an inclusive
        limit on the value: only backends that declare ``caps`` take it).

    Returns
    -------
    values : float32 ndarray (nq, k)
        Best first. Missing slots hold +inf (distances) or -inf (similarities).
    indices : int64 ndarray (nq, k)
        Target row numbers; -1 in missing slots. Ties go to the lower target index.

    Raises
    ------
    ValueError
        Dimension mismatch, k < 1, unknown metric or backend, or no backend accepts the input.

    Notes
    -----
    A query or target row with a NaN or infinite element never matches (a NULL element arrives
    as NaN); for cosine, neither does a zero vector. A query that cannot rank gets an all -1
    row. Fewer than k candidates leave the last slots missing.

    Examples
    --------
    >>> import numpy as np
    >>> q = np.array([[0.0, 0.0]], dtype=np.float32)
    >>> t = np.array([[3.0, 4.0], [1.0, 0.0], [np.nan, 0.0]], dtype=np.float32)
    >>> values, indices = knn(q, t, 3, "l2", backend="reference")
    >>> values.tolist(), indices.tolist()
    ([[1.0, 5.0, inf]], [[1, 0, -1]])
    """
    queries, targets, k = check_inputs(queries, targets, k)
    m = resolve_metric(metric)
    if backend != "auto" and backend not in _REGISTRY:
        raise ValueError(f"backend: expected one of {['auto', *_REGISTRY]}, got {backend!r}")
    nq = queries.shape[0]
    values, indices = empty_result(nq, k, m)
    q_ok = rankable_rows(queries, m)
    t_ok = rankable_rows(targets, m)
    q_rows = None if q_ok.all() else np.flatnonzero(q_ok)
    t_rows = None if t_ok.all() else np.flatnonzero(t_ok)
    q_run = queries if q_rows is None else queries[q_rows]
    t_run = targets if t_rows is None else targets[t_rows]
    if q_run.shape[0] == 0 or t_run.shape[0] == 0:
        if backend != "auto":
            get_backend(backend)  # an unusable named backend still errors
        return values, indices
    chosen = choose_backend(q_run, t_run, k, m, backend, **options)
    logger.debug("knn nq=%d nt=%d d=%d k=%d metric=%s -> %s", q_run.shape[0], t_run.shape[0],
                 queries.shape[1], k, m.name, chosen.name)
    v, i = chosen.run(q_run, t_run, k, m, **options)
    if t_rows is not None:
        i = np.where(i >= 0, t_rows[np.maximum(i, 0)], -1)
    if q_rows is None:
        return v, i
    values[q_rows] = v
    indices[q_rows] = i
    return values, indices

