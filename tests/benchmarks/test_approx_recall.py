"""The approx benchmark's recall@k (benchmarks/approx.py ``recall_of``): ties count as hits,
nothing else does."""
import numpy as np

from benchmarks.approx import recall_of


def _rows(*rows):
    return np.array(rows, dtype=np.float64)


def test_recall_counts_exact_ids_and_tied_ones_only():
    # query 0: k=2 exact neighbours at distance 1 and 2; a third target ties the second
    exact = _rows((0, 10, 1.0), (0, 11, 2.0), (1, 20, 0.5), (1, 21, 0.7))
    assert recall_of(exact, exact, 2) == 1.0
    tied = _rows((0, 10, 1.0), (0, 12, 2.0), (1, 20, 0.5), (1, 21, 0.7))   # 12 ties 11
    assert recall_of(tied, exact, 2) == 1.0
    farther = _rows((0, 10, 1.0), (0, 13, 2.0001), (1, 20, 0.5), (1, 22, 0.9))
    assert recall_of(farther, exact, 2) == 0.5            # one of two for each query
    missing = _rows((0, 10, 1.0))
    assert recall_of(missing, exact, 2) == 0.25           # query 0 half, query 1 none
    # more found rows than exact ones cannot push a query past 1
    many = _rows((0, 10, 1.0), (0, 11, 2.0), (0, 12, 2.0), (1, 20, 0.5), (1, 21, 0.7))
    assert recall_of(many, exact, 2) == 1.0


def test_similarities_rank_descending():
    exact = _rows((0, 1, 0.9), (0, 2, 0.8))
    assert recall_of(_rows((0, 1, 0.9), (0, 3, 0.8)), exact, 1, descending=True) == 1.0
    assert recall_of(_rows((0, 1, 0.9), (0, 3, 0.7)), exact, 1, descending=True) == 0.5
