"""Errors raised to users, with the Spark error classes they already know.

``NearestByJoinError`` carries Spark's error condition (``getCondition()``), e.g.
``NEAREST_BY_JOIN.NUM_RESULTS_OUT_OF_RANGE``, and is both a pyspark ``AnalysisException``
(what Spark's own ``nearestByJoin`` raises) and a ``ValueError`` (what Python code expects
of bad arguments). Other bad arguments raise :class:`ArgumentError` (a ``ValueError``) or
:class:`ArgumentTypeError` (a ``TypeError``); vector columns of another type raise
:class:`VectorTypeError`, naming the side, the column and its type.

Every one of them carries ``argument``, the keyword argument of ``nearest_by_join`` to change
(``"num_results"``, ``"join_type"``, ``"vectors"``), so that callers such as the job runner map
an error to their own names (``join.k``) without reading its text.
"""
from __future__ import annotations

import reprlib

from pyspark.errors import AnalysisException

# Messages quote bad values through short(): a few items of two levels and a few dozen
# characters, so describing a huge (or self-referencing) value costs nothing.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 2, 60, 60, 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4
_MAX_QUOTED = 120


def short(value) -> str:
    """A repr of ``value`` that never walks more than 20 items nor exceeds ~120 characters."""
    text = _SHORT.repr(value)
    return text if len(text) <= _MAX_QUOTED else text[: _MAX_QUOTED - 3] + "..."


def describe(value) -> str:
    """``type value`` for messages; collections also say how many items they hold."""
    size = ""
    if isinstance(value, (list, dict, tuple, set)):
        size = f" of {len(value):,} item{'' if len(value) == 1 else 's'}"
    return f"{type(value).__name__}{size} {short(value)}"

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


# Error condition -> the argument of nearest_by_join it is about.
_ARGUMENTS = {
    "NEAREST_BY_JOIN.NUM_RESULTS_OUT_OF_RANGE": "num_results",
    "NEAREST_BY_JOIN.UNSUPPORTED_MODE": "mode",
    "NEAREST_BY_JOIN.UNSUPPORTED_DIRECTION": "direction",
    "NEAREST_BY_JOIN.UNSUPPORTED_JOIN_TYPE": "join_type",
    "NEAREST_BY_JOIN.DIRECTION_CONTRADICTS_METRIC": "direction",
    "VECTOR_DIMENSION_MISMATCH": "vectors",
}


class _Argument:
    """Fields shared by the argument errors: ``argument`` (the keyword argument of
    ``nearest_by_join``) and ``problem`` (the value found and what was expected)."""

    argument: str
    problem: str


class ArgumentError(_Argument, ValueError):
    """A bad argument value; the message is ``"<argument>: <problem>"``."""

    def __init__(self, argument: str, problem: str):
        self.argument, self.problem = argument, problem
        super().__init__(f"{argument}: {problem}")

    def __reduce__(self):
        return (type(self), (self.argument, self.problem))


class ArgumentTypeError(_Argument, TypeError):
    """An argument of the wrong type; the message is ``"<argument>: <problem>"``."""

    def __init__(self, argument: str, problem: str):
        self.argument, self.problem = argument, problem
        super().__init__(f"{argument}: {problem}")

    def __reduce__(self):
        return (type(self), (self.argument, self.problem))


class VectorTypeError(_Argument, TypeError):
    """A vector column of a type the join cannot read (argument ``vectors``); ``side`` is
    ``"query"`` or ``"target"``, ``column`` its name, ``found`` its type. The message names the
    column, which is what a user fixes."""

    def __init__(self, side: str, column: str, found: str):
        self.side, self.column, self.found = side, column, found
        self.argument = "vectors"
        self.problem = (f"{side} column {column!r}: expected array<float>, array<double> or a "
                        f"dense pyspark.ml VectorUDT, got {found}")
        super().__init__(self.problem)

    def __reduce__(self):
        return (type(self), (self.side, self.column, self.found))


class NearestByJoinError(AnalysisException, ValueError):
    """A bad argument or input, with the Spark error condition as ``getCondition()``."""

    def __init__(self, condition: str, **parameters):
        self.argument = _ARGUMENTS.get(condition)
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
