"""The recall estimate of the IVF plan: recall@k for every nprobe, with its 95% interval.

A sample of the queries is searched exactly (one scan of the target, in
:func:`nearest_join.ivf.estimate_recall`, or within each query's own key in
:func:`nearest_join.ivf_keys.estimate_keyed_recall`); here, from the lists of each sampled
query's true neighbours (:func:`neighbour_lists`) and the rank at which the query probes them,
the share of its neighbours found at every nprobe (:func:`recall_curve`,
:func:`recall_of_ranks`) and the smallest nprobe whose lower 95% bound meets the target
(:class:`RecallCurve`). Pure numpy; both plans share all of it.

**The interval.** The estimate is the mean of the sampled queries' recalls, each in [0, 1].
Its 95% interval is Wilson's score interval with the sample's own variance of those recalls in
place of the bound ``p (1 - p)`` that a proportion's would use (:func:`wilson_interval`):
on real data most queries find all or nearly all of their neighbours, so the recalls vary far
less than a coin of the same mean, and the bound would ask for more probes than the estimate
needs (``benchmarks/approx.py --seeds`` measures how often the target is met). Wilson's own terms in
``z^2 / n`` keep the interval from closing on a sample whose recalls happen to agree. The
queries are drawn from the query table without replacement: the interval narrows by the
finite-population correction, and a sample of every query is the recall itself (its queries
are the join's, its index the join's, and the search inside the probed lists is exact).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Sampled queries of the recall estimate (their exact search is one scan of the target).
RECALL_QUERIES = 1000
# z of the two-sided 95% interval of the recall estimate.
_Z95 = 1.959963984540054


def wilson_interval(estimate: float, n: int, variance: float | None = None, *, population: int | None = None,
                    z: float = _Z95) -> tuple[float, float]:
    """The 95% Wilson score interval of a mean ``estimate`` of ``n`` values in [0, 1] whose
    sample variance is ``variance`` (None: a proportion's, ``estimate (1 - estimate)``, the
    largest such values can have; a larger one is clipped to it).

    ``population``: the values were drawn without replacement from that many (the queries of
    a table): the interval narrows by the finite-population correction (``n`` counts as
    ``n (N - 1) / (N - n)``), and a sample of all of them is the mean itself. ``z``: another
    level than 95% (two-sided)."""
    if n <= 0:
        return 0.0, 1.0
    if population is not None:
        if n >= population:
            return estimate, estimate
        n = n * (population - 1) / (population - n)
    bound = max(estimate * (1 - estimate), 0.0)
    spread = bound if variance is None else min(max(variance, 0.0), bound)
    z2 = z * z
    centre = (estimate + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(spread / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class RecallCurve:
    """Estimated recall@k for each nprobe 1..nlist, from ``queries`` sampled query rows."""

    recall: np.ndarray   # float64 (nlist,): recall[p - 1] at nprobe p
    queries: int         # sampled queries with at least one true neighbour
    # float64 (nlist,): the sample variance of the queries' recalls at each nprobe (None:
    # unknown, the largest values in [0, 1] can have)
    variance: np.ndarray | None = None
    # the queries (with a true neighbour) the sample was drawn from, without replacement (None:
    # unknown, as if infinitely many): a sample of all of them is the recall itself
    population: int | None = None

    def at(self, nprobe: int) -> tuple[float, float, float]:
        """(estimate, lower, upper) at ``nprobe``: the mean per-query recall and its 95%
        interval (:func:`wilson_interval` with the queries' own variance)."""
        estimate = float(self.recall[nprobe - 1]) if self.queries else 1.0
        if nprobe >= self.recall.shape[0]:
            return 1.0, 1.0, 1.0   # every list: the exact search, by construction
        variance = None if self.variance is None else float(self.variance[nprobe - 1])
        lower, upper = wilson_interval(estimate, self.queries, variance, population=self.population)
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
    :func:`~nearest_kernels.kmeans.route` orders them); ``neighbour_lists[i]`` the lists
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
    sums = np.zeros(width)
    squares = np.zeros(width)
    queries = 0
    for rank in ranks:
        if rank.size == 0:
            continue
        own = np.cumsum(np.bincount(np.minimum(rank, width), minlength=width + 1)[:width]) / rank.size
        sums += own
        squares += own * own
        queries += 1
    recall = sums / max(queries, 1)
    variance = None
    if queries >= 2:
        variance = np.maximum(squares - queries * recall * recall, 0.0) / (queries - 1)
    return RecallCurve(recall, queries, variance)


def neighbour_lists(table, queries: int, k: int, metric: str) -> list[np.ndarray]:
    """The lists of each sampled query's k best neighbours over all partitions of a
    ``udfs.ivf.SAMPLE_SCHEMA`` table, ties to the lower (partition, row)."""
    from nearest_kernels import resolve_metric

    query = table.column("query").to_numpy().astype(np.int64)
    value = table.column("value").to_numpy().astype(np.float64)
    lists = table.column("list").to_numpy().astype(np.int64)
    order = table.column("order").to_numpy()
    rank = np.lexsort((order, -value if resolve_metric(metric).descending else value, query))
    query, lists = query[rank], lists[rank]
    starts = np.searchsorted(query, np.arange(queries + 1))
    return [lists[starts[i]:min(starts[i + 1], starts[i] + k)] for i in range(queries)]

