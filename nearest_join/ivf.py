"""``mode="approx"``: an inverted-file (IVF) plan with a recall target, on the keyed plan.

The index (:class:`IVFIndex`, built by :func:`build_ivf_index` or by the planner) is
``nlist`` centroids of a sample of the target, trained by :func:`kernels.kmeans.kmeans`
(deterministic for a seed). The plan:

1. every target row is assigned to its nearest centroid: its *list*, which takes the place
   of the keyed plan's group id (``udfs.lists``), as the rows are packed into blocks (one
   pass: the rows cross from the JVM to Python once);
2. every query row is routed to its ``nprobe`` nearest lists, a ``list<int>`` group column:
   a query in several groups (``udfs.probes``), likewise as it is packed;
3. the broadcast keyed search then searches each query row against the target rows of its
   lists only (small lists batched into one segment search, large ones one kernel call for
   all the queries that probe them) and the parts merge per query with the shared merge;
   for a target too large to broadcast the keyed blocked plan does (lists cut into cells,
   a huge list split into target parts, a query's partials merged per query).

Every pair searched is exact, so the distances returned are exact for the pairs returned;
only the candidate set is approximate. ``nprobe == nlist`` searches every list: the exact
result.

**Choosing nprobe.** The planner draws a sample of the queries (:data:`RECALL_QUERIES`),
finds their exact top k in one scan of the target (``udfs.lists.sample_topk``: each
partition's k best per sampled query and their lists, merged on the driver; one Spark job,
no join plan), and measures for every ``nprobe`` the share of each sampled query's true
neighbours whose list it would probe (the IVF search inside the probed lists is exact, so
that is its recall@k). The smallest
``nprobe`` whose estimate's lower 95% Wilson bound meets ``recall`` runs; the estimate and
its interval are in the plan (``JoinPlan.ivf``). Per-query recall lies in [0, 1], so its
variance is at most ``p (1 - p)``: the Wilson interval of a proportion over the sampled
queries is conservative for it.

**Similarities.** Lists of ``cosine`` and ``inner_product`` joins are trained on normalised
copies (spherical k-means) and probed by cosine. For inner product on unnormalised data the
lists group directions, not scores; the ranking inside the probed lists is the exact inner
product, and the recall estimate measures what routing by direction costs on the data at hand.

**When it runs.** IVF pays a sample job, k-means on the driver and the estimate's scan of
the target before the search: below :data:`IVF_MIN_TARGET_ROWS` target rows, or
:data:`IVF_MIN_WORK_PER_CORE` multiply-adds of exact search per core, ``approx`` runs the exact
plan (Spark's APPROX contract allows it) and the plan says so, unless ``index``, ``nlist`` or
``nprobe`` is given. A target too large to broadcast takes the lists on the keyed blocked plan
(``nearest_join.keyed``): see :func:`ivf_carrier`.

**With on= keys** (a filtered IVF): one index over the whole target, the keyed search's groups
(key, list) pairs: :mod:`nearest_join.ivf_keys`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from dataclasses import dataclass

import numpy as np

from .errors import ArgumentError, ArgumentTypeError, describe, short

logger = logging.getLogger(__name__)

# Sample rows per list for k-means (faiss warns below 39 per centroid) and at most this many.
SAMPLE_ROWS_PER_LIST = 50
MAX_SAMPLE_ROWS = 1 << 18
MAX_LISTS = 1 << 16
# Sampled queries of the recall estimate (their exact search is one scan of the target).
RECALL_QUERIES = 1000
# Below these the exact plan runs (IVF's fixed costs are seconds: a sample job, k-means on
# the driver, the estimate's scan of the target).
IVF_MIN_TARGET_ROWS = 20_000
IVF_MIN_WORK_PER_CORE = 2 * 10**11
# A recall target that needs this share of the lists or more runs the exact plan: the
# per-list searches are narrow (a list's rows of one target block) and cost several times
# more per pair than one search of the whole block, so IVF would be slower than exact.
IVF_MAX_PROBED_SHARE = 0.25
# z of the two-sided 95% interval of the recall estimate.
_Z95 = 1.959963984540054
FORMAT = "nearest_join.ivf_index/1"
_CENTROIDS, _META = "centroids.npy", "ivf_index.json"


def default_nlist(target_rows: int, query_rows: int | None = None) -> int:
    """Lists for a join of ``query_rows`` against ``target_rows``: where what the lists cost
    and what they save balance. Routing measures every target and query row against every
    centroid, (target_rows + query_rows) x nlist distances, and a query's probe searches about
    target_rows / nlist rows, query_rows x target_rows / nlist in all: the sum is smallest at
    nlist = sqrt(query_rows x target_rows / (target_rows + query_rows)), about sqrt(query_rows)
    for few queries against many targets and sqrt(target_rows / 2) for as many of each.
    ``query_rows`` None (an index built before its joins, :func:`build_ivf_index`) counts as
    many queries as targets. Between 1 and :data:`MAX_LISTS`."""
    targets = max(target_rows, 0)
    queries = targets if query_rows is None else max(query_rows, 0)
    balanced = math.sqrt(targets * queries / (targets + queries)) if targets + queries else 0.0
    return int(min(max(1, round(balanced)), MAX_LISTS))


def default_sample_rows(nlist: int, target_rows: int) -> int:
    """Target rows k-means trains on: :data:`SAMPLE_ROWS_PER_LIST` per list, at most
    :data:`MAX_SAMPLE_ROWS` and the target's rows."""
    return int(min(max(target_rows, 0), MAX_SAMPLE_ROWS, SAMPLE_ROWS_PER_LIST * nlist))


@dataclass(frozen=True, eq=False)
class IVFIndex:
    """An IVF index: ``nlist`` centroids and the parameters they were trained with.

    Small (``nlist x dimension`` float32 numbers): :meth:`save` writes it next to a job's
    output, :meth:`load` reads it back, and ``nearest_by_join(..., mode="approx", index=...)``
    reuses it instead of training. ``metric`` is the metric it was trained for; an index of
    the l2 family (l2, sqeuclidean) serves both, as one of the similarities (cosine,
    inner_product) serves both (their lists are trained alike, see :mod:`nearest_join.ivf`).
    ``column`` is the target column it was trained on (None: not recorded); a join on a
    column of another name may use it (see :meth:`check_join`).

    An ``IVFIndex`` that exists is valid, however it was made (trained, loaded or built by
    hand): construction raises ArgumentError (a ValueError) or ArgumentTypeError naming the
    field for centroids that are not a finite float32 ``(nlist, dimension)`` array, a zero
    centroid in an index of the similarities, an unknown metric, or a seed, ``sample_rows``
    or ``iterations`` that is not an int in range. The centroids are kept read-only.
    """

    centroids: np.ndarray   # float32 (nlist, dimension), read-only
    metric: str
    seed: int
    sample_rows: int        # rows k-means was trained on
    iterations: int         # Lloyd iterations run
    column: str | None = None   # the target column trained on (None: not recorded)

    def __post_init__(self) -> None:
        from kernels import resolve_metric
        from kernels.kmeans import routing_metric

        centroids = self.centroids
        if not isinstance(centroids, np.ndarray) or centroids.dtype != np.float32 or centroids.ndim != 2:
            found = (f"{centroids.dtype} of shape {centroids.shape}" if isinstance(centroids, np.ndarray)
                     else describe(centroids))
            raise ArgumentTypeError("centroids", f"expected a float32 numpy array of shape (nlist, dimension), "
                                                 f"got {found}")
        nlist, dimension = centroids.shape
        if not 1 <= nlist <= MAX_LISTS or dimension < 1:
            raise ArgumentError("centroids", f"expected between 1 and {MAX_LISTS} centroids of dimension >= 1, "
                                             f"got shape {centroids.shape}")
        try:
            metric = resolve_metric(self.metric).name
        except ValueError as exc:
            raise ArgumentError("metric", str(exc).split(": ", 1)[-1]) from None
        numbers = {name: _int_argument(name, getattr(self, name), low, optional=False)
                   for name, low in (("seed", 0), ("sample_rows", 1), ("iterations", 0))}
        if numbers["sample_rows"] < nlist:
            raise ArgumentError("sample_rows", f"expected at least nlist = {nlist} (k-means trains nlist centroids "
                                               f"on at least as many rankable rows), got {numbers['sample_rows']}")
        if self.column is not None and (not isinstance(self.column, str) or not self.column):
            raise ArgumentTypeError("column", f"expected None or a column name, got {describe(self.column)}")
        # A NaN or infinite centroid is a target no row can rank against: its list is never
        # probed, so with every centroid bad each row is dropped and the join returns nothing,
        # silently, even at nprobe = nlist. Under the similarities routing is by cosine, and a
        # zero centroid has no direction: it cannot rank either (kernels.kmeans.route).
        nonfinite = ~np.isfinite(centroids).all(axis=1)
        if nonfinite.any():
            raise ArgumentError("centroids", f"expected finite numbers, got NaN or infinity in "
                                             f"{_rows_named(nonfinite)}: no row can be routed to its list")
        if routing_metric(metric) == "cosine":
            zero = ~np.any(centroids != 0, axis=1)
            if zero.any():
                raise ArgumentError("centroids", f"expected no zero centroid in an index for {metric!r} "
                                                 "(its lists are probed by cosine, and a zero vector has no "
                                                 f"direction), got zeros in {_rows_named(zero)}: no row can be "
                                                 "routed to its list")
        if centroids.flags.writeable:
            # A copy, so that no one holding the caller's array can change a checked index.
            centroids = np.array(centroids, dtype=np.float32, order="C")
            centroids.setflags(write=False)
        for name, value in {"centroids": centroids, "metric": metric, **numbers}.items():
            object.__setattr__(self, name, value)   # frozen: normalise in place, once

    @property
    def nlist(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def dimension(self) -> int:
        return int(self.centroids.shape[1])

    @classmethod
    def train(cls, vectors: np.ndarray, metric: str, nlist: int, seed: int = 0,
              column: str | None = None) -> IVFIndex:
        """The index of a sample of target vectors (numpy; no Spark); ``column``: the target
        column they came from, recorded in the index.

        Raises ArgumentError naming ``nlist`` when the sample has fewer rankable rows."""
        from kernels.kmeans import kmeans, training_rows

        rankable = training_rows(vectors, metric).shape[0]
        if not 1 <= nlist <= rankable:
            raise ArgumentError("nlist", f"expected at most the {rankable} rankable target rows sampled "
                                         f"for training (and at least 1), got {nlist}")
        result = kmeans(vectors, nlist, metric, seed=seed)
        centroids = np.ascontiguousarray(result.centroids, dtype=np.float32)
        centroids.setflags(write=False)
        return cls(centroids, metric, int(seed), int(rankable), int(result.iterations), column)

    def route(self, vectors: np.ndarray, nprobe: int = 1, metric: str | None = None) -> np.ndarray:
        """Each row's ``nprobe`` nearest lists, nearest first (-1: a row that cannot rank).

        ``metric``: the join's (default the index's; both of one family): it decides whether a
        zero vector ranks (inner product: it probes lists 0, 1, ...; cosine: it cannot rank), so
        an index trained for cosine routes an inner-product join's zero vectors as that join
        ranks them."""
        from kernels.kmeans import route

        return route(vectors, self.centroids, metric or self.metric, nprobe)

    def check_join(self, metric: str, dimension: int | None) -> None:
        """Raise ArgumentError naming ``index`` unless it serves a join of this metric and
        dimension (None: not known yet, the metric alone is checked).

        The target column's name is not checked: an index trained on ``w`` serves a join on the
        same vectors renamed (a job's prefixed column, an alias), and a matching name would not
        prove the vectors are the same ones. The explanation names the index's column."""
        from kernels.kmeans import routing_metric

        if routing_metric(self.metric) != routing_metric(metric):
            family = "l2 and sqeuclidean" if routing_metric(metric) == "l2" else "cosine and inner_product"
            raise ArgumentError("index", f"expected an index built for {family} (the join ranks by "
                                         f"{metric!r}), got one built for {self.metric!r}")
        if dimension is not None and dimension != self.dimension:
            raise ArgumentError("index", f"expected an index of dimension {dimension} (the join's "
                                         f"vectors), got one of dimension {self.dimension}")

    def save(self, path: str | os.PathLike) -> None:
        """Write the index as a directory: ``centroids.npy`` and ``ivf_index.json``
        (parameters; written last, so a directory without it is no index)."""
        os.makedirs(path, exist_ok=True)
        np.save(os.path.join(path, _CENTROIDS), np.asarray(self.centroids), allow_pickle=False)
        meta = {"format": FORMAT, "metric": self.metric, "seed": self.seed, "nlist": self.nlist,
                "dimension": self.dimension, "sample_rows": self.sample_rows,
                "iterations": self.iterations, "column": self.column}
        temporary = os.path.join(path, _META + ".tmp")
        with open(temporary, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(temporary, os.path.join(path, _META))

    @classmethod
    def load(cls, path: str | os.PathLike) -> IVFIndex:
        """Read an index :meth:`save` wrote (files written before ``column`` was recorded
        load with ``column`` None).

        Raises
        ------
        ValueError
            One for every way the directory is not such an index: the message starts with the
            file at fault (``ivf_index.json`` or ``centroids.npy``) and says what was expected
            and what was found: a key missing, unknown, or of the wrong type or range; a
            centroids file missing, unreadable, truncated or with bytes appended, of another
            dtype or shape than the parameters say, or holding a centroid no row can be routed
            to (see :class:`IVFIndex`).
        """
        meta_path = os.path.join(path, _META)
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"{str(path)!r}: expected an IVF index directory (with {_META}), "
                             "found none; build one with build_ivf_index(...).save(path)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{meta_path!r}: not valid JSON ({exc})") from None
        except OSError as exc:
            raise ValueError(f"{meta_path!r}: cannot be read ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path!r}: expected format {FORMAT!r}, got "
                             f"{short(meta.get('format') if isinstance(meta, dict) else meta)}")
        # An unknown key is refused, not ignored: this format has none, so the file was
        # written by something else, whose meaning this reader cannot honour.
        missing = [key for key in _META_KEYS if key not in meta]
        unknown = sorted(set(meta) - set(_META_KEYS) - {"format", "column"})
        if missing or unknown:
            found = ([f"key {key!r} missing" for key in missing] + [f"unknown key {short(key)}" for key in unknown])
            raise ValueError(f"{meta_path!r}: {', '.join(found)}; expected the keys "
                             f"{['format', *_META_KEYS]} and optionally 'column'")
        try:
            nlist = _int_argument("nlist", meta["nlist"], 1, MAX_LISTS, optional=False)
            dimension = _int_argument("dimension", meta["dimension"], 1, optional=False)
        except (ArgumentError, ArgumentTypeError) as exc:
            raise ValueError(f"{meta_path!r}: key {exc}") from None
        centroids_path = os.path.join(path, _CENTROIDS)
        centroids = _read_centroids(centroids_path, (nlist, dimension))
        try:
            return cls(centroids, meta["metric"], meta["seed"], meta["sample_rows"], meta["iterations"],
                       meta.get("column"))
        except (ArgumentError, ArgumentTypeError) as exc:
            if exc.argument == "centroids":
                raise ValueError(f"{centroids_path!r}: {exc.problem}") from None
            raise ValueError(f"{meta_path!r}: key {exc}") from None

    def __repr__(self) -> str:
        return (f"IVFIndex(nlist={self.nlist}, dimension={self.dimension}, metric={self.metric!r}, "
                f"seed={self.seed}, sample_rows={self.sample_rows}, iterations={self.iterations}, "
                f"column={self.column!r})")


# The keys of ivf_index.json besides "format" (and the optional "column").
_META_KEYS = ("metric", "seed", "nlist", "dimension", "sample_rows", "iterations")


def _rows_named(rows: np.ndarray) -> str:
    """``centroid 2`` or ``3 of the 8 centroids (0, 2, 5)`` for a mask of centroids."""
    found = np.flatnonzero(rows)
    if found.size == 1:
        return f"centroid {found[0]} of {rows.size}"
    listed = ", ".join(map(str, found[:5].tolist())) + (", ..." if found.size > 5 else "")
    return f"{found.size} of the {rows.size} centroids ({listed})"


def _read_centroids(path: str, shape: tuple[int, int]) -> np.ndarray:
    """The float32 array of ``shape`` in the .npy file ``path``, or a ValueError naming it.

    Reads the header first (numpy's own parser, bounded), so a header that claims another
    shape or dtype is refused before any data is read, and so is a file holding fewer or
    more bytes than the header promises (truncated, or something appended)."""
    npy = np.lib.format
    expected = f"expected float32 centroids of shape {shape} (nlist, dimension of {_META}) in numpy's .npy format"
    try:
        with open(path, "rb") as f:
            version = npy.read_magic(f)
            if version == (1, 0):
                found_shape, fortran_order, dtype = npy.read_array_header_1_0(f)
            elif version == (2, 0):
                found_shape, fortran_order, dtype = npy.read_array_header_2_0(f)
            else:
                raise ValueError(f"npy format version {version}, not one numpy.save writes for float32")
            if dtype.str not in ("<f4", ">f4") or tuple(found_shape) != shape:
                raise ValueError(f"dtype {dtype} of shape {tuple(found_shape)}")
            size = shape[0] * shape[1] * 4
            # The file's length before reading: a header may claim more than the file holds.
            stored = os.fstat(f.fileno()).st_size - f.tell()
            if stored != size:
                raise ValueError(f"{stored} bytes of data where the header says {size}: "
                                 f"{'truncated' if stored < size else 'trailing bytes'}")
            data = f.read(size)
    except FileNotFoundError:
        raise ValueError(f"{path!r}: missing; {expected} (IVFIndex.save writes it)") from None
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"{path!r}: {expected}, got {exc}") from None
    centroids = np.frombuffer(data, dtype).reshape(shape, order="F" if fortran_order else "C")
    centroids = np.ascontiguousarray(centroids, dtype=np.float32)
    centroids.setflags(write=False)
    return centroids


def _int_argument(name: str, value, low: int, high: int | None = None, optional: bool = True):
    if value is None and optional:
        return None
    bound = f">= {low}" if high is None else f"between {low} and {high}"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(name, f"expected {'None or ' if optional else ''}an int {bound}, "
                                      f"got {describe(value)}")
    if value < low or (high is not None and value > high):
        raise ArgumentError(name, f"expected {'None or ' if optional else ''}an int {bound}, got {short(value)}")
    return int(value)


def sample_vectors(df, column_name: str, rows: int, total_rows: int, seed: int) -> np.ndarray:
    """About ``rows`` non-NULL vectors of ``df[column_name]``, drawn by Spark's seeded
    sample (deterministic for the same input partitioning), decoded on the driver."""
    from pyspark.sql import functions as F

    from udfs.vectors import decode_vectors

    from .ranking import column, quote

    col = column(df, column_name)
    picked = df.select(col.alias("v")).where(F.col("v").isNotNull())
    table = _sample_table(picked, rows, total_rows, seed)
    return decode_vectors(table.column(0), None, label=quote(column_name))


def _sample_table(picked, rows: int, total_rows: int, seed: int):
    """About ``rows`` rows of ``picked`` (of ``total_rows`` rows at most) as Arrow, Spark's seeded sample."""
    if total_rows > rows:
        # Oversample a little so that the limit, not the draw, decides the count.
        picked = picked.sample(withReplacement=False, fraction=min(1.0, 1.2 * rows / total_rows), seed=seed)
    return picked.limit(rows).toArrow()


def build_ivf_index(target, *, column: str, metric: str, nlist: int | None = None, seed: int = 0,
                    sample: int | None = None) -> IVFIndex:
    """Train an IVF index on a sample of ``target[column]``, for ``nearest_by_join(..., index=...)``.

    Parameters
    ----------
    target : DataFrame
        The target side of the joins the index will serve.
    column : str
        Its vector column (``array<float>``, ``array<double>`` or ML ``VectorUDT``).
    metric : {"l2", "sqeuclidean", "cosine", "inner_product"}
        The joins' metric (lists of the similarities are trained on normalised copies).
    nlist : int, optional
        Lists (centroids); default about sqrt(target rows / 2) (:func:`default_nlist`, for
        joins of as many queries as targets).
    seed : int
        Seeds the sample and k-means: the same input and seed give the same index.
    sample : int, optional
        Target rows to train on; default :data:`SAMPLE_ROWS_PER_LIST` per list (at most
        :data:`MAX_SAMPLE_ROWS`).

    Returns
    -------
    IVFIndex
        ``index.save(path)`` writes it; ``IVFIndex.load(path)`` reads it back. It records
        ``column`` (its ``column``), which a join's explanation names.

    Raises
    ------
    ValueError
        An unknown metric, an ``nlist`` above the rankable rows sampled, or a non-positive
        ``nlist``/``sample``; a TypeError for arguments of the wrong type. Runs two small
        Spark jobs (the row count and the sample).
    """
    from kernels import resolve_metric
    from .ranking import column as column_of

    if not isinstance(column, str) or not column:
        raise ArgumentTypeError("column", f"expected a column name, got {describe(column)}")
    try:
        metric = resolve_metric(metric).name
    except ValueError as exc:
        raise ArgumentError("metric", str(exc).split(": ", 1)[-1]) from None
    nlist = _int_argument("nlist", nlist, 1, MAX_LISTS)
    seed = _int_argument("seed", seed, 0, optional=False)
    sample = _int_argument("sample", sample, 1)
    column_of(target, column)   # a missing column fails here, with Spark's message
    return train_index(target, column, metric, nlist=nlist, seed=seed, sample=sample,
                       target_rows=target.count())


def train_index(target, column_name: str, metric: str, *, nlist: int | None, seed: int,
                sample: int | None, target_rows: int, query_rows: int | None = None) -> IVFIndex:
    """:func:`build_ivf_index` once the arguments are checked and the rows counted
    (``query_rows``: the join's, for the default ``nlist``)."""
    lists = nlist if nlist is not None else default_nlist(target_rows, query_rows)
    rows = sample if sample is not None else default_sample_rows(lists, target_rows)
    vectors = sample_vectors(target, column_name, max(rows, lists), target_rows, seed)
    if nlist is None:   # the default adapts to what the sample holds
        from kernels.kmeans import training_rows

        lists = max(1, min(lists, training_rows(vectors, metric).shape[0]))
    index = IVFIndex.train(vectors, metric, lists, seed, column=column_name)
    logger.info("trained %r on %d sampled target rows", index, vectors.shape[0])
    return index


def load_or_build(path: str, *, rebuild: bool, target, column: str, metric: str,
                  nlist: int | None, seed: int) -> IVFIndex:
    """The index saved at ``path``, or (absent, or ``rebuild``) one trained on ``target``
    and saved there: a nightly job retrains only when asked (the job spec's ``join.index``).

    A saved index that cannot be loaded, or that serves another metric family, raises
    ArgumentError naming ``index`` (the job reports it under ``join.index``); it is not
    silently retrained over."""
    if not rebuild and os.path.exists(os.path.join(path, _META)):
        try:
            index = IVFIndex.load(path)
        except ValueError as exc:
            raise ArgumentError("index", str(exc)) from None
        index.check_join(metric, None)
        logger.info("loaded %r from %s", index, path)
        return index
    index = build_ivf_index(target, column=column, metric=metric, nlist=nlist, seed=seed)
    index.save(path)
    logger.info("saved %r to %s", index, path)
    return index


# ----------------------------------------------------------------------------- recall
def wilson_interval(estimate: float, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``estimate`` over ``n`` trials."""
    if n <= 0:
        return 0.0, 1.0
    z2 = _Z95 * _Z95
    centre = (estimate + z2 / (2 * n)) / (1 + z2 / n)
    half = _Z95 * math.sqrt(max(estimate * (1 - estimate), 0.0) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class RecallCurve:
    """Estimated recall@k for each nprobe 1..nlist, from ``queries`` sampled query rows."""

    recall: np.ndarray   # float64 (nlist,): recall[p - 1] at nprobe p
    queries: int         # sampled queries with at least one true neighbour

    def at(self, nprobe: int) -> tuple[float, float, float]:
        """(estimate, lower, upper) at ``nprobe``: the mean per-query recall and its 95%
        Wilson interval (conservative for a mean of values in [0, 1])."""
        estimate = float(self.recall[nprobe - 1]) if self.queries else 1.0
        if nprobe >= self.recall.shape[0]:
            return 1.0, 1.0, 1.0   # every list: the exact search, by construction
        lower, upper = wilson_interval(estimate, self.queries)
        return estimate, lower, upper

    def smallest_nprobe(self, target: float) -> int:
        """The smallest nprobe whose lower bound meets ``target`` (nlist: every list)."""
        for nprobe in range(1, self.recall.shape[0] + 1):
            if self.at(nprobe)[1] >= target:
                return nprobe
        return self.recall.shape[0]


def recall_curve(query_order: np.ndarray, neighbour_lists: list[np.ndarray]) -> RecallCurve:
    """Recall@k for every nprobe from the lists of the sampled queries' true neighbours.

    ``query_order[i]`` is query ``i``'s lists, nearest first (all nlist of them, as
    :func:`~kernels.kmeans.route` orders them); ``neighbour_lists[i]`` the lists
    of its exact top k. A neighbour is found at nprobe p exactly when its list is among the
    query's first p (the search inside probed lists is exact), so query i's recall at p is
    the share of its neighbours whose list ranks below p. Queries without neighbours (none
    in the exact result) are left out.
    """
    nlist = query_order.shape[1]
    ranks = []
    for order, lists in zip(query_order, neighbour_lists):
        rank = np.full(nlist, nlist, np.int64)
        valid = order >= 0
        rank[order[valid]] = np.flatnonzero(valid)
        ranks.append(rank[lists])
    return recall_of_ranks(ranks, nlist)


def recall_of_ranks(ranks: list[np.ndarray], width: int) -> RecallCurve:
    """Recall@k for every nprobe 1..``width`` from each sampled query's neighbours' probe
    ranks (``ranks[i][j]``: the probe at which query ``i``'s neighbour ``j`` is found, 0 the
    first; ``width`` or more: never). Queries without neighbours are left out."""
    found = np.zeros(width + 1)
    queries = 0
    for rank in ranks:
        if rank.size == 0:
            continue
        found += np.bincount(np.minimum(rank, width), minlength=width + 1)[: width + 1] / rank.size
        queries += 1
    recall = np.cumsum(found[:width]) / max(queries, 1)
    return RecallCurve(recall, queries)


def estimate_recall(planned, index: IVFIndex, seed: int) -> RecallCurve:
    """The recall curve of ``index`` on a sample of ``planned``'s queries: their exact top k
    against the whole target in one scan of it (``udfs.lists.sample_topk``: one Spark job,
    each partition's k best per sampled query with their lists), the partitions' best
    merged here, then :func:`recall_curve`."""
    from pyspark.sql.pandas.types import from_arrow_schema

    from udfs.lists import SAMPLE_SCHEMA, sample_topk
    from udfs.packing import SideLayout

    from .ranking import column, quote

    parsed, plan = planned.parsed, planned.plan
    queries = sample_vectors(planned.query, parsed.query_column, RECALL_QUERIES, plan.query_rows, seed)
    if queries.shape[0] == 0:
        return RecallCurve(np.ones(index.nlist), 0)
    target = planned.target.select(column(planned.target, parsed.target_column))
    layout = SideLayout(parsed.target_column, 0, plan.dimension, 1,
                        expected_from=f"query column {quote(parsed.query_column)}")
    function = functools.partial(sample_topk, layout=layout, queries=queries,
                                 centroids=np.asarray(index.centroids), k=plan.k, metric=parsed.metric,
                                 cap=plan.cap)
    table = target.mapInArrow(function, from_arrow_schema(SAMPLE_SCHEMA)).toArrow()
    neighbour_lists = _neighbour_lists(table, queries.shape[0], plan.k, parsed.metric)
    query_order = np.concatenate([index.route(queries[i:i + 256], index.nlist, parsed.metric)
                                  for i in range(0, queries.shape[0], 256)])
    return recall_curve(query_order, neighbour_lists)


def _neighbour_lists(table, queries: int, k: int, metric: str) -> list[np.ndarray]:
    """The lists of each sampled query's k best neighbours over all partitions of a
    ``udfs.lists.SAMPLE_SCHEMA`` table, ties to the lower (partition, row)."""
    from kernels import resolve_metric

    query = table.column("query").to_numpy().astype(np.int64)
    value = table.column("value").to_numpy().astype(np.float64)
    lists = table.column("list").to_numpy().astype(np.int64)
    order = table.column("order").to_numpy()
    rank = np.lexsort((order, -value if resolve_metric(metric).descending else value, query))
    query, lists = query[rank], lists[rank]
    starts = np.searchsorted(query, np.arange(queries + 1))
    return [lists[starts[i]:min(starts[i + 1], starts[i] + k)] for i in range(queries)]


# ----------------------------------------------------------------------------- on= keys


@dataclass(frozen=True)
class IvfSearch:
    """What the executors need of the IVF plan: the centroids and the lists per query."""

    index: IVFIndex
    nprobe: int
    metric: str   # the join's: how a zero vector routes (IVFIndex.route)

    def packers(self):
        """The packing functions of both sides (``udfs.lists.pack_listed``; ``layout`` left
        to the caller): each row's lists appended as the last column (``C.GROUP``) and the
        rows packed in the same pass, a target row with its list, a query row with its
        ``nprobe`` probed lists."""
        from udfs.lists import pack_listed

        def side(nprobe: int | None):
            return functools.partial(pack_listed, centroids=np.asarray(self.index.centroids),
                                     metric=self.metric, nprobe=nprobe)

        return side(self.nprobe), side(None)

    def listed(self, query, target, q_layout, t_layout):
        """Both sides (``nearest_join.join._inputs``' positional frames, or the vector columns
        alone) with their lists appended as ``C.GROUP`` (``udfs.lists.append_lists``): the keyed blocked plan's
        grouped inputs, a query row's group a ``list<int>`` of its ``nprobe`` lists."""
        from pyspark.sql.types import ArrayType, IntegerType, StructField, StructType

        from udfs import columns as C
        from udfs.lists import append_lists

        def side(df, layout, nprobe, group_type):
            schema = StructType(list(df.schema.fields) + [StructField(C.GROUP, group_type, True)])
            function = functools.partial(append_lists, layout=layout, centroids=np.asarray(self.index.centroids),
                                         metric=self.metric, nprobe=nprobe)
            return df.mapInArrow(function, schema)

        return (side(query, q_layout, self.nprobe, ArrayType(IntegerType(), False)),
                side(target, t_layout, None, IntegerType()))


def _vector_columns(planned):
    """Each side's vector column alone and its layout for routing (``udfs.lists``): what the
    planner's count of the lists reads (the payload columns need not cross to Python)."""
    from udfs.packing import SideLayout

    from .ranking import column, quote

    parsed, plan = planned.parsed, planned.plan
    q_name, t_name = parsed.query_column, parsed.target_column
    return (planned.query.select(column(planned.query, q_name).alias("v")),
            planned.target.select(column(planned.target, t_name).alias("v")),
            SideLayout(q_name, 0, plan.dimension, plan.query_block_rows,
                       expected_from=f"target column {quote(t_name)}"),
            SideLayout(t_name, 0, plan.dimension, plan.target_block_rows,
                       expected_from=f"query column {quote(q_name)}"))


def ivf_carrier(plan) -> str | None:
    """Why the IVF lists cannot ride on ``plan`` (None: they can). The one place that decides.

    IVF lists are keyed-plan groups, and a query row is in ``nprobe`` of them. Both keyed
    plans take that:

    * the broadcast keyed search (``udfs.probes``): one task holds every list, so a query's
      lists are searched and merged in one place, and a huge list is one more kernel call,
      bounded by the broadcast;
    * the keyed blocked plan (``nearest_join.keyed``), for a target too large to broadcast:
      each query row gets a row id and a stage-2 block of its own, then becomes one row per
      probed list (``keyed_layout`` counts it once per probe); each list's bin is cut into
      cells as a key's is (a huge list split into target parts), a cell emits its partial top
      k per stage-2 block, and stage 2 merges each query's partials from all its lists with
      the shared merge (ties to the target met first in input order). The query's payload
      travels once, with its nearest list's copy.

    With ``on=`` keys the groups are (key, list) pairs of one global index and whole keys
    (:class:`nearest_join.ivf_keys.KeyLists`: dense ids, their target rows counted on the driver, so the keyed
    blocked plan's layout can take them), a query probing its nearest lists among those its
    key holds (:class:`nearest_join.ivf_keys.KeyedIvfSearch`); either keyed plan runs them as it runs lists.
    """
    if plan.plan in ("broadcast", "blocked"):
        return None
    return f"the {plan.plan} plan takes no IVF lists"


def describe_carrier(plan, keyed: bool = False) -> str:
    """Which plan carries the IVF lists, in words (the explanation's ``approx`` line);
    ``keyed``: the groups are ``on=`` keys' (key, list) pairs."""
    group = "(key, list) group" if keyed else "list"
    if plan.plan == "broadcast":
        return f"on the broadcast keyed search (the target grouped by {group})"
    from .planner import describe_cells

    return (f"on the keyed blocked plan, the {group} id as the key (the target is too large to broadcast): "
            + describe_cells(plan.key_cells, group))


def plan_approx(planned):
    """``planned`` (a ``PlannedJoin`` of ``mode="approx"``) with its IVF plan, or with the
    reason its exact plan runs, in ``plan.ivf`` (the explanation's ``approx`` line)."""
    from .ivf_keys import (
        KEY_WHOLE_LISTS,
        KeyedIvfSearch,
        all_keys_whole,
        estimate_keyed_recall,
        key_lists,
        keyed_inputs,
        keyed_vector_columns,
    )
    from .ranking import quote

    options, plan, parsed = planned.options, planned.plan, planned.parsed
    explicit = [name for name in ("index", "nlist", "nprobe") if getattr(options, name) is not None]

    def exact(why: str, **figures):
        note = {**figures, "runs": "exact", "explanation": f"runs the exact plan (a valid approximation): {why}"}
        return dataclasses.replace(planned, plan=dataclasses.replace(plan, ivf=note))

    if options.index is not None:
        # plan_join checked it once the facts job knew the dimension; again here, for a
        # PlannedJoin built by other means, before an empty target's exact plan hides it.
        options.index.check_join(parsed.metric, plan.dimension)
    if not plan.dimension or not plan.target_rows:
        return exact("no target vector to build lists of")
    blocked = ivf_carrier(plan)
    if blocked is not None:
        return exact(blocked)
    # With on= keys IVF can win inside a key only: the largest key group bounds its rows and
    # the exact keyed search's work.
    keyed = planned.keys is not None and plan.largest_group is not None
    rows = plan.largest_group if keyed else plan.target_rows
    work = plan.query_rows * rows * plan.dimension
    if not explicit:
        if rows < IVF_MIN_TARGET_ROWS:
            return exact(f"{rows} target rows{' in the largest key group' if keyed else ''} < "
                         f"{IVF_MIN_TARGET_ROWS}, too few for IVF to win (pass nlist, nprobe or index to force it)")
        if work < IVF_MIN_WORK_PER_CORE * plan.cores:
            return exact(f"exact {'keyed ' if keyed else ''}search is {'at most ' if keyed else ''}{work:.3g} "
                         f"multiply-adds, < {IVF_MIN_WORK_PER_CORE:.3g} per core on {plan.cores} cores: too "
                         "little for IVF's fixed costs (pass nlist, nprobe or index to force it)")
    if keyed:
        nlist = (options.index.nlist if options.index is not None
                 else options.nlist or default_nlist(plan.target_rows, plan.query_rows))
        if rows <= KEY_WHOLE_LISTS * plan.target_rows // nlist:
            return exact(all_keys_whole(KEY_WHOLE_LISTS * plan.target_rows // nlist, nlist))
    index = options.index
    if index is not None:
        # The name is not checked (check_join says why); the plan says which column it was built on.
        built = "given, " + ("built on an unrecorded target column" if index.column is None
                             else f"built on target column {quote(index.column)}")
        if index.column is not None and index.column != parsed.target_column:
            built += f", not the join's {quote(parsed.target_column)}"
    else:
        index = train_index(planned.target, parsed.target_column, parsed.metric, nlist=options.nlist,
                            seed=options.seed, sample=None, target_rows=plan.target_rows,
                            query_rows=plan.query_rows)
        built = f"trained on {index.sample_rows} sampled target rows ({index.iterations} Lloyd iterations)"
    if options.nprobe is not None and options.nprobe > index.nlist:
        raise ArgumentError("nprobe", f"expected at most nlist = {index.nlist} (the index's lists), "
                                      f"got {options.nprobe}")
    routing = ("lists of normalised copies, probed by cosine; ranked by the exact "
               f"{parsed.metric}" if parsed.metric in ("cosine", "inner_product") else "lists by l2")
    info = {"runs": "ivf", "nlist": index.nlist, "nprobe": options.nprobe, "seed": index.seed,
            "index": built, "recall_target": options.recall, "recall_estimate": None,
            "recall_interval": None, "recall_queries": 0}
    lists = inputs = None
    if planned.keys is not None:
        inputs = keyed_inputs(planned)
        lists = key_lists(inputs[0][1], inputs[1][1], planned, index)
        info.update(keys_by_lists=lists.keys, key_list_pairs=int(lists.codes.size), key_whole_rows=lists.whole_rows)
        if lists.codes.size == 0:
            return exact(all_keys_whole(lists.whole_rows, index.nlist), **info)
    if options.nprobe is not None:
        nprobe = options.nprobe
        chosen = "given; recall not estimated"
    else:
        if lists is None:
            curve = estimate_recall(planned, index, options.seed)
        else:
            curve = estimate_keyed_recall(planned, index, lists, *inputs, options.seed)
        nprobe = curve.smallest_nprobe(options.recall)
        estimate, lower, upper = curve.at(nprobe)
        chosen = (f"the smallest whose lower bound meets recall={options.recall}: estimated "
                  f"recall@{plan.k} {estimate:.4f}, 95% interval [{lower:.4f}, {upper:.4f}], "
                  f"{curve.queries} sampled queries against exact search"
                  f"{'' if lists is None else ', each within its own key'}")
        info.update(nprobe=nprobe, recall_estimate=estimate, recall_interval=[lower, upper],
                    recall_queries=curve.queries)
        # With keys, of the lists a key's targets occupy: its exact search is its rows only.
        available = (f"nlist={index.nlist} lists" if lists is None
                     else f"the {lists.widest} lists the widest key occupies")
        if nprobe >= IVF_MAX_PROBED_SHARE * (index.nlist if lists is None else lists.widest):
            return exact(f"recall={options.recall} needs nprobe={nprobe} of {available} "
                         f"({chosen}), >= {IVF_MAX_PROBED_SHARE:g} of them: IVF would be slower than the "
                         "exact search (pass nprobe to force it)", **info)
    search = (IvfSearch(index, nprobe, parsed.metric) if lists is None
              else KeyedIvfSearch(index, nprobe, lists, parsed.metric))
    layout = None
    if plan.plan == "blocked":
        # The cells need the groups' sizes on both sides: a job that routes both (as the keyed
        # plan counts its groups at planning).
        from .keyed import layout_of

        columns = _vector_columns(planned) if lists is None else keyed_vector_columns(planned, *inputs)
        layout = layout_of(*search.listed(*columns),
                           target_block_rows=plan.target_block_rows, query_block_rows=plan.query_block_rows,
                           cores=plan.cores, dimension=max(plan.dimension or 1, 1), join_type=plan.join_type)
        plan = dataclasses.replace(plan, key_cells=layout.summary())
    text = (f"IVF: nlist={index.nlist} ({built}, seed {index.seed}; {routing}), nprobe={nprobe} "
            f"({chosen}); ")
    if lists is None:
        text += "targets grouped by list, each query searches its nprobe lists exactly"
    else:
        text += (f"one index over the whole target, inside the on= keys: the {lists.keys} keys of more than "
                 f"{lists.whole_rows} target rows ({KEY_WHOLE_LISTS} lists' worth) grouped by (key, list) "
                 f"({lists.codes.size} pairs, at most {lists.widest} lists per key, counted by a scan of "
                 "the target), each query searching exactly its nprobe nearest lists among those its "
                 "key's targets occupy")
        others = None if plan.key_groups is None else plan.key_groups - lists.keys
        if others is None or others > 0:
            text += f"; {'every other key' if others is None else f'the other {others} keys'} searched whole"
    text += ", " + describe_carrier(plan, keyed=lists is not None)
    if nprobe == index.nlist:
        text += "; nprobe = nlist: every list, the exact result"
    elif lists is not None and nprobe >= lists.widest:
        text += "; nprobe >= the most lists one key occupies: every list of every key, the exact result"
    info["explanation"] = text
    plan = dataclasses.replace(plan, ivf=info)
    return dataclasses.replace(planned, plan=plan, ivf=search, layout=layout)


