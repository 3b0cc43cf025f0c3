"""``mode="approx"`` with ``on=`` keys: the IVF plan of :mod:`nearest_join.ivf` inside key groups.

**With on= keys** (a filtered IVF, as Faiss's filtered search or Milvus's partition keys):
one index over the whole target (``build_ivf_index`` and ``index=`` serve every key), and
the keyed search's groups become (key, list) pairs. A query probes its ``nprobe`` nearest
lists *among those its key's targets occupy* (``udfs.ivf.key_probes``), so a key whose
targets all lie in lists far from the query still yields its nearest rows. A key of at most
:data:`KEY_WHOLE_LISTS` lists' worth of target rows is searched whole, one group, exact (IVF
cannot win on so few rows); when every key is that small, when its largest group is below
:mod:`nearest_join.ivf`'s size thresholds, or when the recall target needs
``IVF_MAX_PROBED_SHARE`` of the lists the widest key occupies, the exact keyed plan runs. NULL keys and keys without targets have no
group, as in the exact keyed plan (LEFT OUTER: one NULL row).

Which lists a key occupies is counted at planning, by one Spark job (:func:`key_lists`: a
scan of the target that routes every row, the pairs of the large keys only sent to the
driver), and reaches the executors as the sorted (key, list) codes in the packing closure;
the ids are dense (pair ``i`` is group ``i``, a whole key ``len(pairs) + key``). The
alternative, deriving the occupancy inside the broadcast search task (it holds every target
row), was not taken: a query row is routed where it is packed, before it meets the targets;
the search task would have to wait for every target block before its first query block and
route queries a second time; and the keyed blocked plan, where no task holds every target
row, needs the same dense ids and their sizes on the driver (``nearest_join.keyed``'s
layout). The job costs one more routing pass over the target at planning. As for the keyed
blocked plan, both inputs must then read the same rows at planning and at the run (a target
row of a (key, list) pair the count did not see has no group).

The recall estimate with keys (:func:`estimate_keyed_recall`) samples queries that have a
key group, ranks each against its own key's targets only (the scan of ``udfs.ivf.sample_topk``
with the groups), and ranks its neighbours' lists among those its key occupies, as the
search probes them; a query of a key searched whole finds its neighbours at the first probe.
The same interval (:mod:`nearest_join.recall`), and ``nprobe == nlist`` (or the most lists
one key occupies) is the exact keyed result.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .ivf_index import IVFIndex, sample_table
from .recall import RECALL_QUERIES, RecallCurve, neighbour_lists, recall_of_ranks

# With on= keys, a key of at most this many lists' worth of target rows (target rows / nlist
# each) is searched whole: IVF cannot win on so few rows (its queries would probe most of
# the few lists they occupy, one small segment each), and a whole search is exact.
KEY_WHOLE_LISTS = 4


@dataclass(frozen=True, eq=False)
class KeyLists:
    """The (key, list) pairs of the keys searched by their lists (``on=`` keys).

    ``codes`` (sorted int64 ``key group * nlist + list``) are the pairs the targets of the
    keys of more than ``whole_rows`` target rows occupy, ``rows`` their target rows; pair
    ``i`` is group ``i`` of the keyed search, a key searched whole is group
    ``len(codes) + key group`` (``udfs.ivf.key_probes``, ``udfs.ivf.target_key_ids``).
    """

    codes: np.ndarray
    rows: np.ndarray
    nlist: int
    whole_rows: int

    @property
    def keys(self) -> int:
        """Keys searched by their lists."""
        return int(np.unique(self.codes // self.nlist).size)

    @property
    def widest(self) -> int:
        """The most lists one such key occupies (0: none)."""
        keys = self.codes // self.nlist
        return int(np.bincount(np.unique(keys, return_inverse=True)[1]).max()) if keys.size else 0


def key_lists(t_input, vector_name: str, planned, index: IVFIndex) -> KeyLists:
    """The :class:`KeyLists` of ``t_input`` (the keyed target, ``nearest_join.inputs.positional_inputs``:
    its vector column ``vector_name``, its key group ``C.GROUP`` last): one Spark job, a scan
    of the target that routes every row to its list (``udfs.ivf.count_key_lists``, a
    partition's pairs counted there) and sends the driver one row per (key, list) pair of the
    keys of more than :data:`KEY_WHOLE_LISTS` lists' worth of rows only."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    from udfs import columns as C
    from udfs.context import SideLayout
    from udfs.ivf import KEY_LIST_SCHEMA, count_key_lists

    from .ranking import quote

    parsed, plan = planned.parsed, planned.plan
    whole_rows = KEY_WHOLE_LISTS * plan.target_rows // index.nlist
    layout = SideLayout(parsed.target_column, 0, plan.dimension, 1,
                        expected_from=f"query column {quote(parsed.query_column)}", group_index=1)
    function = functools.partial(count_key_lists, layout=layout, centroids=np.asarray(index.centroids),
                                 metric=parsed.metric)
    pairs = (t_input.select(vector_name, C.GROUP).mapInArrow(function, from_arrow_schema(KEY_LIST_SCHEMA))
             .groupBy("group", "list").agg(F.sum("rows").alias("rows")))
    listed = (pairs.withColumn("key_rows", F.sum("rows").over(Window.partitionBy("group")))
              .where(F.col("key_rows") > whole_rows).select("group", "list", "rows"))
    table = listed.toArrow()
    codes = (table.column("group").to_numpy().astype(np.int64) * index.nlist
             + table.column("list").to_numpy().astype(np.int64))
    order = np.argsort(codes, kind="stable")
    return KeyLists(codes[order], table.column("rows").to_numpy().astype(np.int64)[order], index.nlist,
                    int(whole_rows))


def estimate_keyed_recall(planned, index: IVFIndex, lists: KeyLists, inputs, vector_names,
                          seed: int) -> RecallCurve:
    """:func:`nearest_join.ivf.estimate_recall` with ``on=`` keys: each sampled query (of a query row with a
    key group) ranked against its own key's targets only (``udfs.ivf.sample_topk`` with
    the groups), and its neighbours' lists ranked among those its key occupies, as
    ``udfs.ivf.key_probes`` probes them; a query of a key searched whole finds all its
    neighbours at the first probe. The curve spans nprobe 1 to :attr:`KeyLists.widest`,
    where every key's every list is probed: the exact result."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    from udfs import columns as C
    from udfs.context import SideLayout
    from udfs.decode import decode_vectors
    from udfs.ivf import SAMPLE_SCHEMA, sample_topk

    from .ranking import quote

    parsed, plan = planned.parsed, planned.plan
    (q_input, t_input), (q_vector, t_vector) = inputs, vector_names
    width = max(lists.widest, 1)
    picked = q_input.select(q_vector, C.GROUP).where(F.col(q_vector).isNotNull() & F.col(C.GROUP).isNotNull())
    table = sample_table(picked, RECALL_QUERIES, plan.query_rows, seed)
    queries = decode_vectors(table.column(0), None, label=parsed.query_column)
    if queries.shape[0] == 0:
        return RecallCurve(np.ones(width), 0)
    groups = table.column(1).to_numpy(zero_copy_only=False).astype(np.int64)
    layout = SideLayout(parsed.target_column, 0, plan.dimension, 1,
                        expected_from=f"query column {quote(parsed.query_column)}", group_index=1)
    function = functools.partial(sample_topk, layout=layout, queries=queries,
                                 centroids=np.asarray(index.centroids), k=plan.k, metric=parsed.metric,
                                 cap=plan.cap, query_groups=groups)
    scanned = t_input.select(t_vector, C.GROUP).mapInArrow(function, from_arrow_schema(SAMPLE_SCHEMA)).toArrow()
    true_lists = neighbour_lists(scanned, queries.shape[0], plan.k, parsed.metric)
    return recall_of_ranks(key_ranks(queries, groups, true_lists, lists, index, parsed.metric), width)


def key_ranks(queries: np.ndarray, groups: np.ndarray, neighbour_lists: list[np.ndarray], lists: KeyLists,
              index: IVFIndex, metric: str) -> list[np.ndarray]:
    """For each query (of key group ``groups[i]``), the probe at which each of its neighbours'
    lists ``neighbour_lists[i]`` is searched: its rank among the lists its key occupies,
    nearest first, as ``udfs.ivf.key_probes`` orders them (0 for every neighbour of a key
    searched whole; ``lists.widest`` or more for a list its key's probes lack)."""
    from udfs.ivf import key_probes

    width = max(lists.widest, 1)
    ranks = []
    for start in range(0, queries.shape[0], 256):
        probes = key_probes(queries[start:start + 256], groups[start:start + 256], lists.codes,
                            np.asarray(index.centroids), metric, index.nlist)
        for row, found in zip(probes, neighbour_lists[start:start + 256]):
            if row[0] >= lists.codes.size:   # a key searched whole: every neighbour at the first probe
                ranks.append(np.zeros(found.size, np.int64))
                continue
            probed = row[row >= 0]
            rank = np.full(index.nlist, width, np.int64)
            rank[lists.codes[probed] % index.nlist] = np.arange(probed.size)
            ranks.append(rank[found])
    return ranks


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True, eq=False)
class KeyedIvfSearch:
    """:class:`nearest_join.ivf.IvfSearch` inside ``on=`` key groups: the group ids of the keyed search are
    the (key, list) pairs of :class:`KeyLists` and the keys searched whole."""

    index: IVFIndex
    nprobe: int
    lists: KeyLists
    metric: str   # the join's: how a zero vector routes (IVFIndex.route)

    def packers(self):
        """The packing functions of both sides (``udfs.ivf.pack_key_listed``; ``layout``
        left to the caller): each row's key group column (the last) replaced by its group
        ids as the rows are packed, a target row's one, a query row's probed ones."""
        from udfs.ivf import pack_key_listed

        def side(nprobe: int | None):
            return functools.partial(pack_key_listed, centroids=np.asarray(self.index.centroids),
                                     metric=self.metric, nprobe=nprobe, key_lists=self.lists.codes)

        return side(self.nprobe), side(None)

    def listed(self, query, target, q_layout, t_layout):
        """Both keyed sides (their key group column at the layouts' ``group_index``) with that
        column replaced by their IVF group ids (``udfs.ivf.replace_key_groups``): the keyed
        blocked plan's grouped inputs, a query row's groups a ``list<bigint>`` of its probed ids."""
        from pyspark.sql.types import ArrayType, LongType, StructField, StructType

        from udfs import columns as C
        from udfs.ivf import replace_key_groups

        def side(df, layout, nprobe, group_type):
            fields = list(df.schema.fields)
            fields[layout.group_index] = StructField(C.GROUP, group_type, True)
            function = functools.partial(replace_key_groups, layout=layout, centroids=np.asarray(self.index.centroids),
                                         metric=self.metric, nprobe=nprobe, key_lists=self.lists.codes)
            return df.mapInArrow(function, StructType(fields))

        return (side(query, q_layout, self.nprobe, ArrayType(LongType(), False)),
                side(target, t_layout, None, LongType()))


def all_keys_whole(whole_rows: int, nlist: int) -> str:
    return (f"with on= keys, every key has at most {whole_rows} target rows ({KEY_WHOLE_LISTS} lists' "
            f"worth of nlist={nlist} lists), too few for IVF to win inside it: each key is searched whole")


def keyed_vector_columns(planned, frames, names):
    """:func:`nearest_join.ivf._vector_columns` with ``on=`` keys: each side's vector column and its key group
    (of :func:`keyed_inputs`' ``frames`` and ``names``), what the blocked plan's count of the
    (key, list) groups reads."""
    from udfs import columns as C
    from udfs.context import SideLayout

    from .ranking import quote

    parsed, plan = planned.parsed, planned.plan
    q_name, t_name = parsed.query_column, parsed.target_column
    (q_frame, t_frame), (q_vector, t_vector) = frames, names
    return (q_frame.select(q_vector, C.GROUP), t_frame.select(t_vector, C.GROUP),
            SideLayout(q_name, 0, plan.dimension, plan.query_block_rows,
                       expected_from=f"target column {quote(t_name)}", group_index=1),
            SideLayout(t_name, 0, plan.dimension, plan.target_block_rows,
                       expected_from=f"query column {quote(q_name)}", group_index=1))


def keyed_inputs(planned):
    """((query, target) with positional names and the key group last, (their vector
    columns' names)): the keyed inputs :func:`nearest_join.inputs.positional_inputs` gives the join."""
    from udfs import columns as C

    from .inputs import positional_inputs
    from .ranking import column_index

    query, target, parsed = planned.query, planned.target, planned.parsed
    names = (C.output_name(column_index(query, parsed.query_column)),
             C.output_name(len(query.columns) + column_index(target, parsed.target_column)))
    return positional_inputs(query, target, planned.keys), names
