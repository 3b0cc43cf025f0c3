"""The IVF index of ``mode="approx"``: ``nlist`` centroids trained by k-means on a sample of the
target (:func:`nearest_kernels.kmeans.kmeans`, deterministic for a seed), saved and loaded back.

:class:`IVFIndex` is the index, valid however it was made (trained, loaded or built by hand);
:func:`build_ivf_index` trains one on a target DataFrame (two small Spark jobs: the row count
and the sample), :func:`training_sample` is the sample the planner trains on once it has counted
the rows (and screens recall on, with the centroids of the first iterations:
:mod:`nearest_join.ivf`), and :func:`load_or_build` serves a job's ``join.index``. The plan
that probes the lists is :mod:`nearest_join.ivf`; the options check
(:mod:`nearest_join.options`) needs only the class and :data:`MAX_LISTS`, which is why they
live here, below both.
"""
from __future__ import annotations

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
        from nearest_kernels import resolve_metric
        from nearest_kernels.kmeans import routing_metric

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
        # zero centroid has no direction: it cannot rank either (nearest_kernels.kmeans.route).
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
        from nearest_kernels.kmeans import MAX_ITERATIONS

        return cls.of_training(cls.start_training(vectors, metric, nlist, seed).run(MAX_ITERATIONS),
                               metric, seed, column)

    @staticmethod
    def start_training(vectors: np.ndarray, metric: str, nlist: int, seed: int = 0):
        """:meth:`train`'s k-means before its first iteration (``nearest_kernels.kmeans.Lloyd``),
        to be run on and read by :meth:`of_training`: the planner screens with the centroids
        of its first iterations."""
        from nearest_kernels.kmeans import Lloyd, training_rows

        rankable = training_rows(vectors, metric).shape[0]
        if not 1 <= nlist <= rankable:
            raise ArgumentError("nlist", f"expected at most the {rankable} rankable target rows sampled "
                                         f"for training (and at least 1), got {nlist}")
        return Lloyd(vectors, nlist, metric, seed=seed)

    @classmethod
    def of_training(cls, lloyd, metric: str, seed: int, column: str | None = None) -> IVFIndex:
        """The index of :meth:`start_training`'s k-means as far as it has run."""
        centroids = np.ascontiguousarray(lloyd.result().centroids, dtype=np.float32)
        centroids.setflags(write=False)
        return cls(centroids, metric, int(seed), int(lloyd.rows), int(lloyd.iterations), column)

    def route(self, vectors: np.ndarray, nprobe: int = 1, metric: str | None = None) -> np.ndarray:
        """Each row's ``nprobe`` nearest lists, nearest first (-1: a row that cannot rank).

        ``metric``: the join's (default the index's; both of one family): it decides whether a
        zero vector ranks (inner product: it probes lists 0, 1, ...; cosine: it cannot rank), so
        an index trained for cosine routes an inner-product join's zero vectors as that join
        ranks them."""
        from nearest_kernels.kmeans import route

        return route(vectors, self.centroids, metric or self.metric, nprobe)

    def check_join(self, metric: str, dimension: int | None) -> None:
        """Raise ArgumentError naming ``index`` unless it serves a join of this metric and
        dimension (None: not known yet, the metric alone is checked).

        The target column's name is not checked: an index trained on ``w`` serves a join on the
        same vectors renamed (a job's prefixed column, an alias), and a matching name would not
        prove the vectors are the same ones. The explanation names the index's column."""
        from nearest_kernels.kmeans import routing_metric

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


def sample_vectors(df, column_name: str, rows: int, total_rows: int, seed: int, source=None) -> np.ndarray:
    """About ``rows`` non-NULL vectors of ``df[column_name]``, drawn by Spark's seeded
    sample (deterministic for the same input partitioning), decoded on the driver.
    ``source``: the column read from its Parquet files (a ``udfs.files.FileRows`` of it
    alone): drawn from them here instead (:func:`file_sample`), no Spark job."""
    from pyspark.sql import functions as F

    from udfs.decode import decode_vectors

    from .ranking import column

    if source is not None:
        return decode_vectors(file_sample(source, rows, seed), None, label=column_name)
    col = column(df, column_name)
    picked = df.select(col.alias("v")).where(F.col("v").isNotNull())
    table = sample_table(picked, rows, total_rows, seed)
    return decode_vectors(table.column(0), None, label=column_name)


def file_sample(source, rows: int, seed: int):
    """The non-NULL values among ``rows`` rows of a column read from its files (a
    ``udfs.files.FileRows`` of it alone), each row as likely as any other (seeded: the same
    rows for the same files), in the files' order: one pass over the files, only the drawn rows
    kept. All of them where the files hold at most ``rows``."""
    import pyarrow as pa

    n = source.rows
    picked = np.arange(n) if n <= rows else np.sort(np.random.default_rng(seed).choice(n, rows, replace=False))
    parts, at = [], 0
    for batch in source.rows_between(0, n):
        lo, hi = np.searchsorted(picked, (at, at + batch.num_rows))
        if hi > lo:
            parts.append(batch.column(0).take(pa.array(picked[lo:hi] - at)))
        at += batch.num_rows
    values = pa.concat_arrays(parts) if parts else pa.array([], source.types[0])
    return values.filter(values.is_valid())


def sample_table(picked, rows: int, total_rows: int, seed: int):
    """At most ``rows`` rows of ``picked`` (of ``total_rows`` rows at most) as Arrow, each row
    as likely as any other: Spark's seeded sample, a little larger than ``rows``, then
    ``rows`` of its rows drawn on the driver (seeded; kept in their order).

    Cutting the sample with ``limit`` instead would keep the first partitions' rows and drop
    the last ones': the recall estimate's queries and the index's training rows would lean to
    whatever the first partitions hold (on real embeddings whose partitions hold different
    sources, the estimate read above the recall the join then reached)."""
    if total_rows <= rows:
        return picked.limit(rows).toArrow()
    # Oversample so that the draw almost never yields fewer than ``rows``.
    fraction = min(1.0, 1.2 * rows / total_rows)
    table = picked.sample(withReplacement=False, fraction=fraction, seed=seed).toArrow()
    if table.num_rows <= rows:
        return table
    keep = np.sort(np.random.default_rng(seed).choice(table.num_rows, rows, replace=False))
    return table.take(keep)


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
        Spark jobs (the row count and the sample), or none where ``target`` is a plain scan
        of local Parquet files that a join's tasks would read from them (the footers count its
        rows; the sample is drawn from the files: :func:`sample_vectors`).
    """
    from nearest_kernels import resolve_metric

    from .parquet_scan import file_rows
    from .ranking import column as column_of
    from .ranking import column_index

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
    files = file_rows(target, list(target.columns), 1)
    if files is not None:
        files = files.only(column_index(target, column))
    return train_index(target, column, metric, nlist=nlist, seed=seed, sample=sample,
                       target_rows=target.count() if files is None else files.rows, source=files)


def train_index(target, column_name: str, metric: str, *, nlist: int | None, seed: int,
                sample: int | None, target_rows: int, query_rows: int | None = None, source=None) -> IVFIndex:
    """:func:`build_ivf_index` once the arguments are checked and the rows counted
    (``query_rows``: the join's, for the default ``nlist``; ``source``: the column read from
    its files, :func:`sample_vectors`)."""
    vectors, lists = training_sample(target, column_name, metric, nlist=nlist, seed=seed, sample=sample,
                                     target_rows=target_rows, query_rows=query_rows, source=source)
    index = IVFIndex.train(vectors, metric, lists, seed, column=column_name)
    logger.info("trained %r on %d sampled target rows", index, vectors.shape[0])
    return index


def training_sample(target, column_name: str, metric: str, *, nlist: int | None, seed: int,
                    sample: int | None, target_rows: int,
                    query_rows: int | None = None, source=None) -> tuple[np.ndarray, int]:
    """The sampled target vectors an index is trained on, and its lists: ``nlist``, or the
    default for the rows, at most the sample's rankable rows. ``source``: the vector column
    read from its files (:func:`sample_vectors`)."""
    lists = nlist if nlist is not None else default_nlist(target_rows, query_rows)
    rows = sample if sample is not None else default_sample_rows(lists, target_rows)
    vectors = sample_vectors(target, column_name, max(rows, lists), target_rows, seed, source)
    if nlist is None:   # the default adapts to what the sample holds
        from nearest_kernels.kmeans import training_rows

        lists = max(1, min(lists, training_rows(vectors, metric).shape[0]))
    return vectors, lists


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

