"""``mode="approx"``: an inverted-file (IVF) plan with a recall target, on the keyed plan.

The index (:class:`nearest_join.ivf_index.IVFIndex`, built by
:func:`~nearest_join.ivf_index.build_ivf_index` or by the planner) is ``nlist`` centroids of a
sample of the target, trained by :func:`nearest_kernels.kmeans.kmeans` (deterministic for a seed). The
plan:

1. every target row is assigned to its nearest centroid: its *list*, which takes the place
   of the keyed plan's group id (``udfs.ivf``), as the rows are packed into blocks (one
   pass: the rows cross from the JVM to Python once);
2. every query row is routed to its ``nprobe`` nearest lists, a ``list<int>`` group column:
   a query in several groups (``udfs.search.probed_search``), likewise as it is packed;
3. the broadcast keyed search then searches each query row against the target rows of its
   lists only (small lists batched into one segment search, large ones one kernel call for
   all the queries that probe them) and the parts merge per query with the shared merge;
   for a target too large to broadcast the keyed blocked plan does (lists cut into cells,
   a huge list split into target parts, a query's partials merged per query).

Every pair searched is exact, so the distances returned are exact for the pairs returned;
only the candidate set is approximate. ``nprobe == nlist`` searches every list: the exact
result.

**Choosing nprobe.** The planner draws a sample of the queries
(:data:`nearest_join.recall.RECALL_QUERIES`; fewer where the lists select so sharply that their
scan would cost more than the search, :func:`estimate_sample`), finds their exact top k in one
scan of the target (``udfs.ivf.sample_topk``: each partition's k best per sampled query and
their lists, merged on the driver; one Spark job, no join plan), and measures for every
``nprobe`` the share of each sampled query's true neighbours whose list it would probe (the IVF
search inside the probed lists is exact, so that is its recall@k: :mod:`nearest_join.recall`).
The smallest ``nprobe`` whose estimate's lower 95% bound meets ``recall`` runs (the interval of
a mean of per-query recalls, from their own variance, narrowed by the share of the query table
sampled: :mod:`nearest_join.recall`); the estimate and its interval are in the plan
(``JoinPlan.ivf``).

**Similarities.** Lists of ``cosine`` and ``inner_product`` joins are trained on normalised
copies (spherical k-means) and probed by cosine. For inner product on unnormalised data the
lists group directions, not scores; the ranking inside the probed lists is the exact inner
product, and the recall estimate measures what routing by direction costs on the data at hand.

**When it runs.** IVF pays a sample job, k-means on the driver and the estimate's scan of
the target before the search: below :data:`IVF_MIN_TARGET_ROWS` target rows, or
:data:`IVF_MIN_WORK_PER_CORE` multiply-adds of exact search per core, ``approx`` runs the exact
plan (Spark's APPROX contract allows it) and the plan says so, unless ``index``, ``nlist`` or
``nprobe`` is given. Nor does it when the recall target needs :data:`IVF_MAX_PROBED_SHARE` of
the lists or more; data on which IVF cannot select at all (isotropic Gaussians) is told before
the estimate's scan of the target, from the index's own training sample (:func:`screen_recall`).
Nor on tasks that search on GPUs (:func:`nearest_join.planner.gpu_tasks`): there the exact
search of the whole target costs less than IVF's training and routing on the CPU alone, and a
GPU task searches the probed lists one call per list (``benchmarks/gpu_approx.py``).
A target too large to broadcast takes the lists on the keyed blocked plan
(``nearest_join.keyed``): see :func:`ivf_carrier`.

**With on= keys** (a filtered IVF): one index over the whole target, the keyed search's groups
(key, list) pairs: :mod:`nearest_join.ivf_keys`.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
from dataclasses import dataclass

import numpy as np

from .errors import ArgumentError
from .ivf_index import IVFIndex, default_nlist, sample_vectors, training_sample
from .recall import RECALL_QUERIES, RecallCurve, neighbour_lists, recall_curve

logger = logging.getLogger(__name__)

# Below these the exact plan runs (IVF's fixed costs are seconds: a sample job, k-means on
# the driver, the estimate's scan of the target).
IVF_MIN_TARGET_ROWS = 20_000
IVF_MIN_WORK_PER_CORE = 2 * 10**11
# A recall target that needs this share of the lists or more runs the exact plan: the lists
# queries probe are the larger ones (real data's lists are uneven), a probed pair costs more
# than an exact one (a CPU task searches its block's probed lists in one call, but each
# list's last tile is padded; a GPU task makes one call per list), and the routing, the
# sampling, k-means and the recall estimate come on top, so IVF would be slower than exact.
IVF_MAX_PROBED_SHARE = 0.25
# A recall target that needs this share of the lists against the index's own training sample
# runs the exact plan without the estimate's scan of the target (:func:`screen_recall`). A
# sample's neighbours lie farther from their queries than the whole target's, in more lists,
# so the sample needs as many lists or more than the target: far above IVF_MAX_PROBED_SHARE,
# only data whose lists cannot select (isotropic Gaussians: about half of them) stops here.
IVF_SCREEN_SHARE = 0.4
# The screen runs on the centroids of the first few Lloyd iterations, and only a join that
# passes it trains on (the same k-means, run on): the verdict on data whose lists cannot
# select is the same after a few iterations as after all of them, and such data needs most.
SCREEN_ITERATIONS = 5
# The estimate's scan costs its sampled queries x the target's rows, the search it plans about
# the query rows x the target's rows x the share of the lists probed: where lists select
# sharply (few probed of many) the whole sample's scan would cost more than the search. The
# sample is cut to ESTIMATE_SHARE of the query rows the search multiplies by the whole target
# (the screen's share of the lists, which probes as many lists as the target's sample needs
# or more), down to MIN_RECALL_QUERIES: its interval is then wider, so a larger nprobe is
# chosen, never a lower recall.
ESTIMATE_SHARE = 0.5
MIN_RECALL_QUERIES = 250


def vector_files(files, query, target, parsed) -> tuple:
    """Each side's vector column alone as its tasks read it from its files (``udfs.files.FileRows``;
    ``files``: the sides' as ``PlannedJoin.files`` holds them), None for a side Spark reads."""
    from .ranking import column_index

    if files is None:
        return None, None
    return tuple(None if side is None else side.only(column_index(df, name))
                 for side, df, name in zip(files, (query, target), (parsed.query_column, parsed.target_column)))


def sampled_queries(planned, seed: int) -> np.ndarray:
    """The recall estimate's sample of ``planned``'s query vectors (one small Spark job, or a
    pass over its files)."""
    parsed = planned.parsed
    source = vector_files(planned.files, planned.query, planned.target, parsed)[0]
    return sample_vectors(planned.query, parsed.query_column, RECALL_QUERIES, planned.plan.query_rows, seed, source)


def draw_samples(query, target, parsed, options, query_rows: int, target_rows: int, screening: bool,
                 files=None):
    """(training sample, nlist, the screen's query sample or None): what an IVF plan that
    trains its own index draws from inputs of ``query_rows`` and ``target_rows`` rows, the two
    samples' Spark jobs (or passes over the files of sides read from them: ``files``, as
    ``PlannedJoin.files``) at once; the query sample only for the ``screening``
    (:func:`plan_approx`)."""
    q_source, t_source = vector_files(files, query, target, parsed)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nj-sample") as pool:
        query_sample = (pool.submit(sample_vectors, query, parsed.query_column, RECALL_QUERIES, query_rows,
                                    options.seed, q_source)
                        if screening else None)
        sample, nlist = training_sample(target, parsed.target_column, parsed.metric, nlist=options.nlist,
                                        seed=options.seed, sample=None, target_rows=target_rows,
                                        query_rows=query_rows, source=t_source)
        return sample, nlist, None if query_sample is None else query_sample.result()


class EarlySamples:
    """:func:`draw_samples` started before the facts job, beside it, where both sides' rows are
    known without a job (:func:`nearest_join.planner.known_rows`): the samples are those the
    plan would draw after the facts job, drawn sooner. :meth:`result` hands them over only
    when the facts job counted the same rows; else the plan draws its own."""

    def __init__(self, query, target, parsed, options, query_rows: int, target_rows: int, files=None):
        self.rows = (query_rows, target_rows)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nj-early-sample")
        self._drawn = self._pool.submit(draw_samples, query, target, parsed, options, query_rows, target_rows,
                                        options.nprobe is None, files)
        self._pool.shutdown(wait=False)

    @classmethod
    def start(cls, query, target, parsed, options, files=None) -> "EarlySamples | None":
        """The samples of a join that trains its own IVF index on the CPU, started now, or None
        (no such join, or rows not known without a job; ``files``: the sides read from their
        files, as ``PlannedJoin.files``, drawn from there). ``approx`` without ``nlist`` or
        ``nprobe`` on a target of fewer than :data:`IVF_MIN_TARGET_ROWS` rows runs exact: none
        either."""
        from .planner import gpu_tasks, known_rows

        if options.mode != "approx" or options.index is not None or options.on is not None:
            return None
        if options.nlist is None and options.nprobe is None and gpu_tasks(query.sparkSession,
                                                                           options.backend) is not None:
            return None
        target_rows = known_rows(target)
        if target_rows is None or (target_rows < IVF_MIN_TARGET_ROWS and options.nlist is None
                                   and options.nprobe is None):
            return None
        query_rows = known_rows(query)
        if query_rows is None:
            return None
        return cls(query, target, parsed, options, query_rows, target_rows, files)

    def result(self, query_rows: int, target_rows: int):
        """The drawn samples when the facts job counted ``query_rows`` and ``target_rows``,
        else None; waits for the draw either way (no Spark job of the plan's outlives it)."""
        try:
            drawn = self._drawn.result()
        except Exception:   # noqa: BLE001 (the plan's own draw meets the same input and says what failed)
            logger.info("the early samples failed; the plan draws its own", exc_info=True)
            return None
        return drawn if self.rows == (query_rows, target_rows) else None

    def wait(self) -> None:
        """Returns once the draw has ended (its Spark jobs with it)."""
        concurrent.futures.wait([self._drawn])


def estimate_recall(planned, index: IVFIndex, seed: int, queries: np.ndarray | None = None) -> RecallCurve:
    """The recall curve of ``index`` on a sample of ``planned``'s queries (``queries``, else
    :func:`sampled_queries`): their exact top k against the whole target in one scan of it
    (``udfs.ivf.sample_topk``: one Spark job, each partition's k best per sampled query with
    their lists), the partitions' best merged here, then :func:`recall_curve`."""
    from pyspark.sql.pandas.types import from_arrow_schema

    from udfs.context import SideLayout
    from udfs.files import read_then
    from udfs.ivf import SAMPLE_SCHEMA, sample_topk

    from .ranking import column, quote

    parsed, plan = planned.parsed, planned.plan
    if queries is None:
        queries = sampled_queries(planned, seed)
    if queries.shape[0] == 0:
        return RecallCurve(np.ones(index.nlist), 0)
    layout = SideLayout(parsed.target_column, 0, plan.dimension, 1,
                        expected_from=f"query column {quote(parsed.query_column)}")
    function = functools.partial(sample_topk, layout=layout, queries=queries,
                                 centroids=np.asarray(index.centroids), k=plan.k, metric=parsed.metric,
                                 cap=plan.cap)
    source = vector_files(planned.files, planned.query, planned.target, parsed)[1]
    if source is not None:   # each task scans its share of the target's files
        spark = planned.target.sparkSession
        target = spark.range(source.tasks, numPartitions=source.tasks)
        function = functools.partial(read_then, function=function, source=source)
    else:
        target = planned.target.select(column(planned.target, parsed.target_column))
    table = target.mapInArrow(function, from_arrow_schema(SAMPLE_SCHEMA)).toArrow()
    true_lists = neighbour_lists(table, queries.shape[0], plan.k, parsed.metric)
    curve = recall_curve(_probe_order(index, queries, parsed.metric), true_lists)
    # Drawn from the query table without replacement: the queries with a true neighbour among
    # its rows, in the sample's proportion rounded up (more than the sample's unless it drew
    # every row; all of them: the estimate is the join's recall).
    return dataclasses.replace(curve, population=-(-plan.query_rows * curve.queries // queries.shape[0]))


def screen_recall(index: IVFIndex, queries: np.ndarray, sample: np.ndarray, k: int, metric: str,
                  cap: float | None) -> RecallCurve:
    """The recall curve of ``index`` for ``queries`` against its own training ``sample`` in
    place of the whole target: on the driver, no Spark job. The sample's neighbours are
    farther, in more lists (:data:`IVF_SCREEN_SHARE`): a screen for data on which IVF cannot
    win, not the estimate the plan's nprobe comes from."""
    from nearest_kernels import knn

    if queries.shape[0] == 0 or sample.shape[0] == 0:
        return RecallCurve(np.ones(index.nlist), 0)
    wide = np.promote_types(queries.dtype, sample.dtype)
    _, rows = knn(queries.astype(wide, copy=False), sample.astype(wide, copy=False), min(k, sample.shape[0]),
                  metric, backend="cpu", cap=cap)
    sample_lists = index.route(sample, 1, metric)[:, 0]
    true_lists = [sample_lists[row[row >= 0]] for row in rows]
    return recall_curve(_probe_order(index, queries, metric), true_lists)


def estimate_sample(queries: np.ndarray, probed_share: float, query_rows: int, seed: int) -> np.ndarray:
    """The sampled ``queries`` the estimate searches: all of them, or a seeded uniform subset
    of ESTIMATE_SHARE x ``query_rows`` x ``probed_share`` rows (at least
    :data:`MIN_RECALL_QUERIES`) where the search probes a small share of the lists, in
    their order.

    >>> estimate_sample(np.zeros((1000, 2)), 1 / 300, 100_000, 0).shape
    (250, 2)
    >>> estimate_sample(np.zeros((1000, 2)), 0.1, 64_000, 0).shape
    (1000, 2)
    """
    wanted = int(max(MIN_RECALL_QUERIES, ESTIMATE_SHARE * query_rows * probed_share))
    if wanted >= queries.shape[0]:
        return queries
    return queries[np.sort(np.random.default_rng(seed).choice(queries.shape[0], wanted, replace=False))]


def _probe_order(index: IVFIndex, queries: np.ndarray, metric: str) -> np.ndarray:
    """Each query's lists, nearest first (all of them)."""
    return np.concatenate([index.route(queries[i:i + 256], index.nlist, metric)
                           for i in range(0, queries.shape[0], 256)])


@dataclass(frozen=True)
class IvfSearch:
    """What the executors need of the IVF plan: the centroids and the lists per query."""

    index: IVFIndex
    nprobe: int
    metric: str   # the join's: how a zero vector routes (IVFIndex.route)

    def packers(self):
        """The packing functions of both sides (``udfs.ivf.pack_listed``; ``layout`` left
        to the caller): each row's lists appended as the last column (``C.GROUP``) and the
        rows packed in the same pass, a target row with its list, a query row with its
        ``nprobe`` probed lists."""
        from udfs.ivf import pack_listed

        def side(nprobe: int | None):
            return functools.partial(pack_listed, centroids=np.asarray(self.index.centroids),
                                     metric=self.metric, nprobe=nprobe)

        return side(self.nprobe), side(None)

    def listed(self, query, target, q_layout, t_layout):
        """Both sides (``nearest_join.inputs.positional_inputs``' frames, or the vector columns
        alone) with their lists appended as ``C.GROUP`` (``udfs.ivf.append_lists``): the keyed blocked plan's
        grouped inputs, a query row's group a ``list<int>`` of its ``nprobe`` lists."""
        from pyspark.sql.types import ArrayType, IntegerType, StructField, StructType

        from udfs import columns as C
        from udfs.ivf import append_lists

        def side(df, layout, nprobe, group_type):
            schema = StructType(list(df.schema.fields) + [StructField(C.GROUP, group_type, True)])
            function = functools.partial(append_lists, layout=layout, centroids=np.asarray(self.index.centroids),
                                         metric=self.metric, nprobe=nprobe)
            return df.mapInArrow(function, schema)

        return (side(query, q_layout, self.nprobe, ArrayType(IntegerType(), False)),
                side(target, t_layout, None, IntegerType()))


def _vector_columns(planned):
    """Each side's vector column alone and its layout for routing (``udfs.ivf``): what the
    planner's count of the lists reads (the payload columns need not cross to Python)."""
    from udfs.context import SideLayout

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

    * the broadcast keyed search (``udfs.search``): one task holds every list, so a query's
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


def plan_approx(planned, samples: EarlySamples | None = None):
    """``planned`` (a ``PlannedJoin`` of ``mode="approx"``) with its IVF plan, or with the
    reason its exact plan runs, in ``plan.ivf`` (the explanation's ``approx`` line).
    ``samples``: the samples drawn beside the facts job, used if it counted the rows they
    assumed."""
    from .ivf_keys import (
        KEY_WHOLE_LISTS,
        KeyedIvfSearch,
        all_keys_whole,
        estimate_keyed_recall,
        key_lists,
        keyed_inputs,
        keyed_vector_columns,
    )
    from .planner import gpu_tasks
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
    # With on= keys IVF can win inside a key only: the largest key group bounds its rows and
    # the exact keyed search's work.
    keyed = planned.keys is not None and plan.largest_group is not None
    rows = plan.largest_group if keyed else plan.target_rows
    work = plan.query_rows * rows * plan.dimension
    if not explicit:   # (the local plan's joins are all too small: its reason is the size)
        if rows < IVF_MIN_TARGET_ROWS:
            return exact(f"{rows} target rows{' in the largest key group' if keyed else ''} < "
                         f"{IVF_MIN_TARGET_ROWS}, too few for IVF to win (pass nlist, nprobe or index to force it)")
        if work < IVF_MIN_WORK_PER_CORE * plan.cores:
            return exact(f"exact {'keyed ' if keyed else ''}search is {'at most ' if keyed else ''}{work:.3g} "
                         f"multiply-adds, < {IVF_MIN_WORK_PER_CORE:.3g} per core on {plan.cores} cores: too "
                         "little for IVF's fixed costs (pass nlist, nprobe or index to force it)")
        gpus = gpu_tasks(planned.target.sparkSession, options.backend)
        if gpus is not None:
            return exact(f"the tasks search on GPUs ({gpus}), where the exact search of the whole target "
                         "is faster than IVF's training, routing and list-by-list search (pass nlist, "
                         "nprobe or index to force it)")
    blocked = ivf_carrier(plan)
    if blocked is not None:
        return exact(blocked)
    if keyed:
        nlist = (options.index.nlist if options.index is not None
                 else options.nlist or default_nlist(plan.target_rows, plan.query_rows))
        if rows <= KEY_WHOLE_LISTS * plan.target_rows // nlist:
            return exact(all_keys_whole(KEY_WHOLE_LISTS * plan.target_rows // nlist, nlist))
    index, screen = options.index, None
    if index is not None:
        # The name is not checked (check_join says why); the plan says which column it was built on.
        built = "given, " + ("built on an unrecorded target column" if index.column is None
                             else f"built on target column {quote(index.column)}")
        if index.column is not None and index.column != parsed.target_column:
            built += f", not the join's {quote(parsed.target_column)}"
    else:
        screening = options.nprobe is None and planned.keys is None
        # (early samples are drawn without keys only: their query sample is the screen's)
        drawn = None if samples is None else samples.result(plan.query_rows, plan.target_rows)
        if drawn is None:
            drawn = draw_samples(planned.query, planned.target, parsed, options, plan.query_rows,
                                 plan.target_rows, screening, planned.files)
        sample, nlist, queries = drawn
        training = IVFIndex.start_training(sample, parsed.metric, nlist, options.seed)
        if screening:
            training.run(SCREEN_ITERATIONS)
            early = IVFIndex.of_training(training, parsed.metric, options.seed, parsed.target_column)
            screen = screen_recall(early, queries, sample, plan.k, parsed.metric, plan.cap)
            needed = screen.smallest_nprobe(options.recall)
            # (a screen of few queries with neighbours has a wide interval: no verdict)
            if screen.queries >= RECALL_QUERIES // 2 and needed >= IVF_SCREEN_SHARE * early.nlist:
                estimate, lower, upper = screen.at(needed)
                info = {"runs": "ivf", "nlist": early.nlist, "nprobe": needed, "seed": early.seed,
                        "index": f"screened with the centroids of {early.iterations} Lloyd iterations on "
                                 f"{early.sample_rows} sampled target rows",
                        "recall_target": options.recall, "recall_estimate": estimate,
                        "recall_interval": [lower, upper], "recall_queries": screen.queries,
                        "recall_against": "training sample"}
                return exact(f"recall={options.recall} needs nprobe={needed} of nlist={early.nlist} lists "
                             f"against the index's own {sample.shape[0]} training rows (estimated "
                             f"recall@{plan.k} {estimate:.4f}, 95% interval [{lower:.4f}, {upper:.4f}], "
                             f"{screen.queries} sampled queries, centroids of {early.iterations} Lloyd "
                             f"iterations), >= {IVF_SCREEN_SHARE:g} of them: the whole target needs about "
                             "as many, and IVF would be slower than the exact search (its recall estimate "
                             "against the target was not run; pass nprobe to force IVF)", **info)
        from nearest_kernels.kmeans import MAX_ITERATIONS

        index = IVFIndex.of_training(training.run(MAX_ITERATIONS), parsed.metric, options.seed,
                                     parsed.target_column)
        logger.info("trained %r on %d sampled target rows", index, sample.shape[0])
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
        if lists is None and screen is None:   # a given index: no training sample to screen on
            curve = estimate_recall(planned, index, options.seed)
        elif lists is None:
            # The screen's share (of lists the sample needs, by the first centroids) is at
            # least the target's: the estimate's sample is cut by it.
            curve = estimate_recall(planned, index, options.seed,
                                    queries=estimate_sample(queries, needed / index.nlist, plan.query_rows,
                                                            options.seed))
        else:
            curve = estimate_keyed_recall(planned, index, lists, *inputs, options.seed)
        nprobe = curve.smallest_nprobe(options.recall)
        estimate, lower, upper = curve.at(nprobe)
        chosen = (f"the smallest whose lower bound meets recall={options.recall}: estimated "
                  f"recall@{plan.k} {estimate:.4f}, 95% interval [{lower:.4f}, {upper:.4f}], "
                  f"{curve.queries} sampled queries against exact search"
                  f"{'' if lists is None else ', each within its own key'}")
        info.update(nprobe=nprobe, recall_estimate=estimate, recall_interval=[lower, upper],
                    recall_queries=curve.queries, recall_against="target")
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


