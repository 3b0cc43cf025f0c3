"""Which metric and which two vector columns a ranking names.

A ranking is either a metric name (``"l2"``, ``"sqeuclidean"``, ``"cosine"``,
``"inner_product"``) with ``vectors=``, or a Spark Column built by one of the three vector
functions over one column of each side. Columns are read without touching the JVM, so this
works the same under classic PySpark and Spark Connect: Connect columns expose their
unresolved expression tree (with the DataFrame each reference came from); classic columns
are read from their SQL text. Anything else (an expression over the vectors, a literal, a
column name found on neither or ambiguously on both sides) returns None, and the caller hands
the join to Spark's own ``nearestByJoin``.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from nearest_join.kernels import METRICS

logger = logging.getLogger(__name__)

# Spark function name -> kernel metric.
SPARK_FUNCTIONS = {
    "vector_l2_distance": "l2",
    "vector_cosine_similarity": "cosine",
    "vector_inner_product": "inner_product",
}
DIRECTIONS = {"l2": "distance", "sqeuclidean": "distance", "cosine": "similarity",
              "inner_product": "similarity"}

_CALL = re.compile(r"^Column<'(\w+)\((.*)\)'>$", re.DOTALL)
_IDENT = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*|`(?:[^`]|``)+`)$")


@dataclass(frozen=True)
class Ranking:
    """A ranking the fast path can run: metric plus the query and target vector columns."""

    metric: str
    query_column: str
    target_column: str
    source: str  # what the user wrote, for logs and errors

    @property
    def direction(self) -> str:
        return DIRECTIONS[self.metric]


def quote(name: str) -> str:
    """``name`` as a Spark column reference meaning exactly the column called ``name``.

    Spark parses the string given to ``df[...]`` / ``F.col``: a dot separates struct fields
    or a qualifier (``emb.v1`` -> field ``v1`` of ``emb``) and a lone backtick is a syntax
    error. Inside backticks the name is literal, with backticks doubled.
    """
    return "`" + name.replace("`", "``") + "`"


def column(df, name: str):
    """The Column of ``df`` called ``name`` (any characters; the name must be unique)."""
    return df[quote(name)]


def _unquote(identifier: str) -> str:
    if identifier.startswith("`"):
        return identifier[1:-1].replace("``", "`")
    return identifier


def _split_args(text: str) -> list[str] | None:
    """Split top-level comma-separated arguments; None if any is not a plain identifier."""
    parts, depth, quoted, current = [], 0, False, ""
    for ch in text:
        if ch == "`":
            quoted = not quoted
        elif not quoted and ch in "([":
            depth += 1
        elif not quoted and ch in ")]":
            depth -= 1
        if ch == "," and depth == 0 and not quoted:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    if not all(_IDENT.match(p) for p in parts):
        return None
    return [_unquote(p) for p in parts]


def _find(name: str, columns: list[str]) -> str | None:
    """The column called ``name`` (case-insensitively, as Spark resolves); None if absent
    or ambiguous."""
    hits = [c for c in columns if c.lower() == name.lower()]
    exact = [c for c in hits if c == name]
    if len(exact) == 1:
        return exact[0]
    return hits[0] if len(hits) == 1 else None


def _connect_call(ranking, query, target):
    """(function, [(name, side or None)]) from a Spark Connect column, else None."""
    if not type(ranking).__module__.startswith("pyspark.sql.connect"):
        return None  # classic Columns answer any attribute with a nested field Column
    expr = getattr(ranking, "_expr", None)
    if expr is None or not hasattr(expr, "_name") or not hasattr(expr, "_args"):
        return None
    plan_ids = {}
    for side, df in (("query", query), ("target", target)):
        plan = getattr(df, "_plan", None)
        if plan is not None and getattr(plan, "_plan_id", None) is not None:
            plan_ids[plan._plan_id] = side
    args = []
    for arg in expr._args:
        name = getattr(arg, "_unparsed_identifier", None)
        if name is None:
            return (expr._name, None)
        args.append((name, plan_ids.get(getattr(arg, "_plan_id", None))))
    return (expr._name, args)


def parse_ranking(ranking, query, target, vectors=None) -> Ranking | None:
    """Read the metric and the vector columns of a ranking; None means "let Spark run it".

    Raises
    ------
    ValueError
        A metric name without usable ``vectors``, an unknown metric name, or a vector column
        missing from its side.
    """
    q_cols, t_cols = list(query.columns), list(target.columns)
    if isinstance(ranking, str):
        if ranking not in METRICS:
            raise ValueError(
                f"ranking: expected a vector function Column or one of {sorted(METRICS)}, got {ranking!r}"
            )
        if isinstance(vectors, str):
            q_name = t_name = vectors
        elif isinstance(vectors, (tuple, list)) and len(vectors) == 2 and all(isinstance(v, str) for v in vectors):
            q_name, t_name = vectors
        else:
            raise ValueError(
                "vectors: expected a column name present on both sides or a (query_column, "
                f"target_column) pair when ranking is a metric name, got {vectors!r}"
            )
        q_col, t_col = _find(q_name, q_cols), _find(t_name, t_cols)
        if q_col is None:
            raise ValueError(f"vectors: query column {q_name!r} not found (query columns: {q_cols})")
        if t_col is None:
            raise ValueError(f"vectors: target column {t_name!r} not found (target columns: {t_cols})")
        return Ranking(ranking, q_col, t_col, ranking)

    if vectors is not None:
        raise ValueError("vectors: only used with a metric-name ranking; the ranking Column names its columns")
    text = str(ranking)
    connect = _connect_call(ranking, query, target)
    if connect is not None:
        function, args = connect
        if args is None or function not in SPARK_FUNCTIONS or len(args) != 2:
            return None
    else:
        match = _CALL.match(text)
        if not match or match.group(1) not in SPARK_FUNCTIONS:
            return None
        names = _split_args(match.group(2))
        if names is None or len(names) != 2:
            return None
        function, args = match.group(1), [(n, None) for n in names]
    metric = SPARK_FUNCTIONS[function]
    (a, side_a), (b, side_b) = args
    options = []
    for (qn, qs), (tn, ts) in (((a, side_a), (b, side_b)), ((b, side_b), (a, side_a))):
        if qs not in (None, "query") or ts not in (None, "target"):
            continue
        q_col, t_col = _find(qn, q_cols), _find(tn, t_cols)
        if q_col is not None and t_col is not None:
            options.append((q_col, t_col))
    options = list(dict.fromkeys(options))
    if len(options) != 1:
        logger.debug("ranking %s: columns resolve %d ways", text, len(options))
        return None
    return Ranking(metric, options[0][0], options[0][1], text)
