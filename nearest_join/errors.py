"""Errors raised to users, with the Spark error classes they already know.

``NearestByJoinError`` carries Spark's error condition (``getCondition()``), e.g.
``NEAREST_BY_JOIN.NUM_RESULTS_OUT_OF_RANGE``, and is both a pyspark ``AnalysisException``
(what Spark's own ``nearestByJoin`` raises) and a ``ValueError`` (what Python code expects
of bad arguments). Vector type problems raise ``TypeError`` naming the column and its type.
"""
from __future__ import annotations

from pyspark.errors import AnalysisException

# Spark's message texts (sql/core error-conditions.json, 4.3), so users see familiar words.
_MESSAGES = {
    "NEAREST_BY_JOIN.NUM_RESULTS_OUT_OF_RANGE": (
        "Invalid nearest-by join. The number of results {numResults} must be between "
        "{min} and {max}."
    ),
    "NEAREST_BY_JOIN.UNSUPPORTED_MODE": (
        "Invalid nearest-by join. Unsupported nearest-by join mode '{mode}'. "
        "Supported modes include: 'approx', 'exact'."
    ),
    "NEAREST_BY_JOIN.UNSUPPORTED_DIRECTION": (
        "Invalid nearest-by join. Unsupported nearest-by join direction '{direction}'. "
        "Supported nearest-by join directions include: 'distance', 'similarity'."
    ),
    "NEAREST_BY_JOIN.UNSUPPORTED_JOIN_TYPE": (
        "Invalid nearest-by join. Unsupported nearest-by join type {joinType}. "
        "Supported types: 'INNER', 'LEFT OUTER'."
    ),
    "NEAREST_BY_JOIN.DIRECTION_CONTRADICTS_METRIC": (
        "Invalid nearest-by join. The direction '{direction}' contradicts the metric "
        "'{metric}', which is a {expected}: use direction='{expected}' or leave it None."
    ),
    "VECTOR_DIMENSION_MISMATCH": (
        "Vectors passed to `{function}` must have the same dimension, but got {left} and "
        "{right} ({detail})."
    ),
}


class NearestByJoinError(AnalysisException, ValueError):
    """A bad argument or input, with the Spark error condition as ``getCondition()``."""

    def __init__(self, condition: str, **parameters):
        self._condition = condition
        self._parameters = {k: str(v) for k, v in parameters.items()}
        text = _MESSAGES[condition].format(**parameters)
        super().__init__(message=text)

    def getCondition(self) -> str:  # noqa: N802 - Spark's spelling
        return self._condition

    def getErrorClass(self) -> str:  # noqa: N802 - older Spark spelling
        return self._condition

    def getSqlState(self) -> str:  # noqa: N802
        return "22000" if self._condition == "VECTOR_DIMENSION_MISMATCH" else "42604"

    def __reduce__(self):  # picklable, so executors can raise it too
        return (_rebuild, (self._condition, self._parameters))

    def getMessageParameters(self) -> dict:  # noqa: N802
        return dict(self._parameters)


def _rebuild(condition: str, parameters: dict) -> "NearestByJoinError":
    return NearestByJoinError(condition, **parameters)
