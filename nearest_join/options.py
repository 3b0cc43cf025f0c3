"""The options of one join, validated once: :class:`JoinOptions`.

``nearest_by_join`` and ``explain_nearest_join`` take Spark-like keyword arguments (that is
the public contract); the first thing either does is build one ``JoinOptions`` from them, and
from then on planning and execution read that object, never the loose arguments. The job
runner builds the same object from a YAML spec (``jobs.spec``), so a spec and a call are
checked by the same code and fail with the same words.

Every check lives in ``__post_init__``: a ``JoinOptions`` that exists is valid, whether it was
built from a call, from a spec or by ``dataclasses.replace``. Errors name the argument, the
value found and what was expected, and carry ``argument`` (see :mod:`nearest_join.errors`).
Spark's own checks (k, mode, direction, join type) raise Spark's error conditions, in Spark's
order.

A new option is a new field here (with its default and its check) plus the keyword argument
of the two public functions; planning and the executors receive it through this object.
Options that name columns (``vectors``, ``on``) are checked for their shape here and resolved
against the DataFrames by the planner (:func:`nearest_join.ranking.parse_ranking`,
:func:`nearest_join.ranking.parse_keys`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from pyspark.sql import Column

from udfs.columns import MAX_BLOCK_ROWS

from .errors import ArgumentError, ArgumentTypeError, NearestByJoinError, describe, short

MIN_RESULTS, MAX_RESULTS = 1, 100_000
MODES = ("exact", "approx")
DIRECTIONS = ("distance", "similarity")
BACKENDS = ("auto", "cpu", "gpu", "reference")
# The recall@k target of mode="approx" when none is given.
DEFAULT_RECALL = 0.95
# "auto": the fastest exact precision of the device a task gets (see JoinOptions.precision).
PRECISIONS = ("auto", "fp32", "tf32", "bf16")


def _join_type(value) -> str:
    # Spark's own normalisation: case-insensitive, underscores ignored ("left_outer" == "leftouter").
    key = value.lower().replace("_", "") if isinstance(value, str) else None
    if key == "inner":
        return "inner"
    if key in ("left", "leftouter"):
        return "leftouter"
    raise NearestByJoinError("NEAREST_BY_JOIN.UNSUPPORTED_JOIN_TYPE",
                             joinType=value if isinstance(value, str) else short(value))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(name: str, value, low: int, high: int | None = None) -> int | None:
    if value is None:
        return None
    bound = f">= {low}" if high is None else f"between {low} and {high}"
    if not _is_int(value):
        raise ArgumentTypeError(name, f"expected None or an int {bound}, got {describe(value)}")
    if value < low or (high is not None and value > high):
        raise ArgumentError(name, f"expected None or an int {bound}, got {short(value)}")
    return value


def _choice(name: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ArgumentError(name, f"expected one of {list(choices)}, got {short(value)}")
    return value


def _vectors(value) -> str | tuple[str, str] | None:
    if value is None:
        return None
    if isinstance(value, str) and value:
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, str) and v for v in value):
        return (value[0], value[1])
    raise ArgumentError("vectors", "expected a column name present on both sides or a (query_column, "
                                   f"target_column) pair, got {short(value)}")


def _on(value):
    """``on`` normalised: None, a tuple of (query column, target column) name pairs, or a
    pyspark Column (an equality, or ``&`` of equalities, resolved by the planner)."""
    if value is None:
        return None
    if isinstance(value, Column):
        return value
    expected = ("expected None, a column name present on both sides, a list of them, a list of "
                "(query_column, target_column) pairs, or a Column equality between a query and a "
                "target column (or & of them)")
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ArgumentError("on", f"{expected}, got {short(value)}")
    pairs = []
    for item in items:
        if isinstance(item, str) and item:
            pairs.append((item, item))
        elif (isinstance(item, (list, tuple)) and len(item) == 2
              and all(isinstance(n, str) and n for n in item)):
            pairs.append((item[0], item[1]))
        else:
            raise ArgumentError("on", f"{expected}, got {short(value)} (item {short(item)})")
    if len(set(pairs)) != len(pairs):
        raise ArgumentError("on", f"{expected}, each pair once, got {short(value)}")
    return tuple(pairs)


DISTANCE_METRICS = ("l2", "sqeuclidean")
SIMILARITY_METRICS = ("cosine", "inner_product")
# The values a similarity can take (inner products are unbounded).
SIMILARITY_RANGES = {"cosine": (-1.0, 1.0)}


def _optional_cap(name: str, value, nonnegative: bool) -> float | None:
    if value is None:
        return None
    expected = "None or a finite number" + (" >= 0" if nonnegative else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(name, f"expected {expected}, got {describe(value)}")
    value = float(value)
    if not math.isfinite(value) or (nonnegative and value < 0):
        raise ArgumentError(name, f"expected {expected}, got {short(value)}")
    return value


def _approx_options(options, mode: str) -> dict:
    """``recall``, ``nlist``, ``nprobe``, ``seed`` and ``index`` checked (the IVF plan of
    ``mode="approx"``; nlist, nprobe and index mean nothing to the exact mode)."""
    from .ivf_index import MAX_LISTS, IVFIndex

    recall = options.recall
    if recall is not None:
        if isinstance(recall, bool) or not isinstance(recall, (int, float)):
            raise ArgumentTypeError("recall", f"expected a number in (0, 1], got {describe(recall)}")
        if not 0 < recall <= 1:
            raise ArgumentError("recall", f"expected a number in (0, 1] (the target recall@k), got {short(recall)}")
    nlist = _optional_int("nlist", options.nlist, 1, MAX_LISTS)
    nprobe = _optional_int("nprobe", options.nprobe, 1)
    seed = options.seed
    if seed is not None and not _is_int(seed):
        raise ArgumentTypeError("seed", f"expected an int >= 0, got {describe(seed)}")
    if seed is not None and seed < 0:
        raise ArgumentError("seed", f"expected an int >= 0, got {short(seed)}")
    index = options.index
    if index is not None and not isinstance(index, IVFIndex):
        raise ArgumentTypeError("index", f"expected None or an IVFIndex (build_ivf_index, IVFIndex.load), "
                                         f"got {describe(index)}")
    if mode != "approx":
        # All five shape the IVF plan only: one given to the exact mode is a forgotten
        # mode="approx", not a setting to ignore.
        for name, value in (("recall", recall), ("nlist", nlist), ("nprobe", nprobe), ("seed", seed),
                            ("index", index)):
            if value is not None:
                raise ArgumentError(name, f"applies to mode='approx' (the IVF plan), got {short(value)} "
                                          f"with mode={mode!r}")
        return {"recall": None, "nlist": None, "nprobe": None, "seed": None}
    if index is not None and nlist is not None:
        raise ArgumentError("nlist", f"expected None with index (the index has its {index.nlist} lists), "
                                     f"got {nlist}")
    lists = index.nlist if index is not None else nlist
    if nprobe is not None and lists is not None and nprobe > lists:
        raise ArgumentError("nprobe", f"expected at most nlist = {lists} (lists probed per query), got {nprobe}")
    return {"recall": DEFAULT_RECALL if recall is None else float(recall), "nlist": nlist, "nprobe": nprobe,
            "seed": 0 if seed is None else seed}


@dataclass(frozen=True)
class JoinOptions:
    """Everything about a join except its inputs and ranking, validated and normalised.

    Fields are named after the keyword arguments of :func:`nearest_join.nearest_by_join` (see
    its docstring for their meaning); values are normalised (``mode`` and ``direction`` lower
    case, ``join_type`` ``"inner"`` or ``"leftouter"``, ``vectors`` a name or a pair, ``on``
    None, a tuple of ``(query_column, target_column)`` pairs or the Column as given).

    ``precision="auto"`` is resolved by each executor for the device its task got: bf16 on a
    GPU of compute capability 8.0 or more, fp32 on older GPUs; CPU executors search in
    float32 and re-rank in float64 whatever the precision. Results are exact in every
    precision.

    Examples
    --------
    >>> JoinOptions(num_results=5, join_type="left_outer").join_type
    'leftouter'
    >>> JoinOptions(num_results=0)
    Traceback (most recent call last):
    ...
    nearest_join.errors.NearestByJoinError: [NEAREST_BY_JOIN.NUM_RESULTS_OUT_OF_RANGE] Invalid nearest-by join. The number of results 0 must be between 1 and 100000.
    """

    num_results: int = 1
    mode: str = "exact"
    direction: str | None = None
    vectors: str | tuple[str, str] | None = None
    join_type: str = "inner"
    distance_col: str | None = None
    keep_vectors: bool = True
    backend: str = "auto"
    precision: str = "auto"
    broadcast_limit_bytes: int | None = None
    query_block_rows: int | None = None
    target_block_rows: int | None = None
    max_distance: float | None = None
    min_similarity: float | None = None
    on: object = None   # None | ((query_column, target_column), ...) | a Column equality
    # mode="approx" (the IVF plan, nearest_join.ivf): target recall@k, lists, lists probed
    # per query, the seed of sampling and k-means, a prebuilt nearest_join.ivf_index.IVFIndex.
    # None: the default under approx (recall DEFAULT_RECALL, seed 0); all stay None in exact mode.
    recall: float | None = None
    nlist: int | None = None
    nprobe: int | None = None
    seed: int | None = None
    index: object = None

    @classmethod
    def from_arguments(cls, arguments: dict) -> JoinOptions:
        """The options among a public function's keyword arguments (``locals()`` at its top):
        the fields by name, so that a new field cannot be forgotten by one of the functions."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls)})

    def __post_init__(self) -> None:
        # Spark's checks first, in Spark's order, with Spark's error conditions.
        k = self.num_results
        if not _is_int(k):
            raise ArgumentTypeError("num_results", f"expected an int between {MIN_RESULTS} and "
                                                   f"{MAX_RESULTS}, got {describe(k)}")
        if not MIN_RESULTS <= k <= MAX_RESULTS:
            raise NearestByJoinError("NEAREST_BY_JOIN.NUM_RESULTS_OUT_OF_RANGE",
                                     numResults=k, min=MIN_RESULTS, max=MAX_RESULTS)
        if not isinstance(self.mode, str) or self.mode.lower() not in MODES:
            raise NearestByJoinError("NEAREST_BY_JOIN.UNSUPPORTED_MODE",
                                     mode=self.mode if isinstance(self.mode, str) else short(self.mode))
        direction = self.direction
        if direction is not None and (not isinstance(direction, str) or direction.lower() not in DIRECTIONS):
            raise NearestByJoinError("NEAREST_BY_JOIN.UNSUPPORTED_DIRECTION",
                                     direction=direction if isinstance(direction, str) else short(direction))
        normalised = {
            "mode": self.mode.lower(),
            "direction": direction.lower() if direction else None,
            "join_type": _join_type(self.join_type),
            "vectors": _vectors(self.vectors),
            "backend": _choice("backend", self.backend, BACKENDS),
            "precision": _choice("precision", self.precision, PRECISIONS),
            "broadcast_limit_bytes": _optional_int("broadcast_limit_bytes", self.broadcast_limit_bytes, 0),
            "query_block_rows": _optional_int("query_block_rows", self.query_block_rows, 1, MAX_BLOCK_ROWS),
            "target_block_rows": _optional_int("target_block_rows", self.target_block_rows, 1, MAX_BLOCK_ROWS),
            "max_distance": _optional_cap("max_distance", self.max_distance, nonnegative=True),
            "min_similarity": _optional_cap("min_similarity", self.min_similarity, nonnegative=False),
            "on": _on(self.on),
        }
        if normalised["max_distance"] is not None and normalised["min_similarity"] is not None:
            raise ArgumentError("min_similarity",
                                f"expected None when max_distance is given (max_distance caps "
                                f"{' and '.join(DISTANCE_METRICS)}, min_similarity {' and '.join(SIMILARITY_METRICS)}), "
                                f"got {short(self.min_similarity)} with max_distance {short(self.max_distance)}")
        normalised.update(_approx_options(self, normalised["mode"]))
        if self.distance_col is not None and (not isinstance(self.distance_col, str) or not self.distance_col):
            raise ArgumentError("distance_col", f"expected None or a non-empty column name, got {short(self.distance_col)}")
        if not isinstance(self.keep_vectors, bool):
            raise ArgumentTypeError("keep_vectors", f"expected True or False, got {describe(self.keep_vectors)}")
        for name, value in normalised.items():
            object.__setattr__(self, name, value)   # frozen: normalise in place, once

    def cap(self, metric: str) -> float | None:
        """The distance cap of a join ranked by ``metric``, in its units (inclusive): the
        ``max_distance`` of l2 and sqeuclidean (for sqeuclidean a squared distance), the
        ``min_similarity`` of cosine and inner_product; None without one. The argument that
        does not fit the metric is an ArgumentError naming both.

        >>> JoinOptions(max_distance=2).cap("l2")
        2.0
        >>> JoinOptions(max_distance=2).cap("cosine")
        Traceback (most recent call last):
        ...
        nearest_join.errors.ArgumentError: max_distance: caps the distance metrics l2 and sqeuclidean, not the similarity 'cosine'; pass min_similarity instead
        >>> JoinOptions(min_similarity=1.5).cap("cosine")
        Traceback (most recent call last):
        ...
        nearest_join.errors.ArgumentError: min_similarity: expected a cosine similarity in [-1, 1], got 1.5
        """
        if metric in DISTANCE_METRICS:
            if self.min_similarity is not None:
                raise ArgumentError("min_similarity", f"caps the similarity metrics {' and '.join(SIMILARITY_METRICS)}, "
                                                      f"not the distance {metric!r}; pass max_distance instead")
            return self.max_distance
        if self.max_distance is not None:
            raise ArgumentError("max_distance", f"caps the distance metrics {' and '.join(DISTANCE_METRICS)}, "
                                                f"not the similarity {metric!r}; pass min_similarity instead")
        low, high = SIMILARITY_RANGES.get(metric, (-math.inf, math.inf))
        if self.min_similarity is not None and not low <= self.min_similarity <= high:
            # Above the range no target can match and every query loses every row; below it
            # the cap is no cap. Either is a mistake about the metric's scale, not a request.
            raise ArgumentError("min_similarity", f"expected a {metric} similarity in [{low:g}, {high:g}], "
                                                  f"got {short(self.min_similarity)}")
        return self.min_similarity

    @property
    def k(self) -> int:
        """``num_results``, under the name the planner and the kernels use."""
        return self.num_results
