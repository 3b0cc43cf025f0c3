"""Which metric and which two vector columns a ranking names, and which side each is on.

A ranking is either a metric name (``"l2"``, ``"sqeuclidean"``, ``"cosine"``,
``"inner_product"``) with ``vectors=``, or a Spark Column built by one of the three vector
functions over one column of each side.

A Column is read in two steps. Its text (classic PySpark) or its expression tree (Spark
Connect) gives the function and the *names* of its two arguments. A name does not say which
side a column is on: ``t.v`` prints as ``v`` whether or not the query also has a ``v``. So
each reading "query column ``a``, target column ``b``" that the names allow is put to
Spark's analyzer, which knows where every attribute comes from (expression ids in classic
PySpark, plan ids under Connect): the reading holds when the ranking resolves against the
query cut down to ``a`` joined with the target cut down to ``b``, and against neither side
alone. Only DataFrame analysis is used (no JVM handle), so this works the same under classic
PySpark and Spark Connect.

Spark's vector functions take ``array<float>`` only, and its analyzer checks types before it
places a column on a side: over ``array<double>`` or ``VectorUDT`` columns (which the join
takes) each argument is placed on its own, as a bare column reference, which has no type to
refuse (:func:`_reading_by_placement`). Under Connect that is exact; classic PySpark shows
only the argument's printed name, so a plain name two columns of one side could carry is an
error, not a guess.

Anything else (an expression over the vectors, a literal, both arguments on one side, a
column Spark cannot place) returns None, and the caller hands the join to Spark's own
``nearestByJoin``. A ranking whose two different columns resolve on *both* sides (one
DataFrame joined with itself) is an error: nothing, Spark included, can tell which column
is the query's.
"""
from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass

from pyspark.errors import AnalysisException

from nearest_kernels import METRICS

from .errors import ArgumentError, VectorTypeError

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


def _reference(name: str) -> str:
    """``name`` as written in a reference: bare when Spark reads it as it is, else quoted."""
    return name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else quote(name)


def column(df, name: str):
    """The Column of ``df`` called ``name`` (any characters; the name must be unique)."""
    return df[quote(name)]


def column_index(df, name: str) -> int:
    """The position of the one column of ``df`` called ``name``."""
    positions = [i for i, c in enumerate(df.columns) if c == name]
    if len(positions) != 1:
        raise ValueError(f"column {name!r}: expected exactly one column of that name, found {len(positions)}")
    return positions[0]


def vector_itemsize(df, name: str, side: str) -> int:
    """Bytes per element of the vector column ``name`` of ``df`` (the ``side`` of the join).

    The one check of a vector column's type, shared by the join and the job runner.

    Raises
    ------
    VectorTypeError
        The column is not ``array<float>``, ``array<double>`` or a pyspark.ml ``VectorUDT``;
        the error names the side, the column and its type.
    """
    from pyspark.sql.types import ArrayType, DoubleType, FloatType

    dtype = df.schema.fields[column_index(df, name)].dataType
    if isinstance(dtype, ArrayType) and isinstance(dtype.elementType, FloatType):
        return 4
    if isinstance(dtype, ArrayType) and isinstance(dtype.elementType, DoubleType):
        return 8
    if type(dtype).__name__ == "VectorUDT":
        return 8
    raise VectorTypeError(side, name, dtype.simpleString())


def _name_parts(text: str) -> list[str] | None:
    """A multi-part identifier as Spark parses it (``a.`b.c``` -> ["a", "b.c"]); None if
    it is not one."""
    parts, i, n = [], 0, len(text)
    while True:
        if text.startswith("`", i):
            part, j = [], i + 1
            while True:
                k = text.find("`", j)
                if k < 0:
                    return None
                if text.startswith("``", k):
                    part.append(text[j:k + 1])
                    j = k + 2
                    continue
                part.append(text[j:k])
                i = k + 1
                break
            parts.append("".join(part))
        else:
            k = text.find(".", i)
            end = n if k < 0 else k
            if not text[i:end] or "`" in text[i:end]:
                return None
            parts.append(text[i:end])
            i = end
        if i == n:
            return parts
        if text[i] != ".":
            return None
        i += 1


def _names(text: str) -> list[str]:
    """Column names an argument printed as ``text`` may refer to: the text itself (classic
    PySpark prints some names unquoted), the parsed name, and the last part of a qualified
    one (``a.v`` through an alias ``a``). The analyzer rejects the wrong ones."""
    out = [text]
    parts = _name_parts(text)
    if parts:
        out.append(parts[-1])
    return list(dict.fromkeys(out))


def _find(name: str, columns: list[str]) -> str | None:
    """The column called ``name`` (case-insensitively, as Spark resolves); None if absent
    or ambiguous."""
    hits = [c for c in columns if c.lower() == name.lower()]
    exact = [c for c in hits if c == name]
    if len(exact) == 1:
        return exact[0]
    return hits[0] if len(hits) == 1 else None


def _call(ranking) -> tuple[str, list[tuple[str, str]]] | None:
    """(function name, [(first argument text, second argument text), ...]) of a two-argument
    call whose arguments are plain column references; None otherwise.

    A Connect column carries its expression tree, so its arguments are known exactly. A
    classic column is read from its SQL text, where a name holding ", " makes the split
    ambiguous: every split is returned and the analyzer picks.
    """
    if type(ranking).__module__.startswith("pyspark.sql.connect"):
        # Classic Columns answer any attribute with a nested field Column: only Connect here.
        expr = getattr(ranking, "_expr", None)
        args = getattr(expr, "_args", None)
        if expr is None or args is None or len(args) != 2:
            return None
        names = [getattr(arg, "_unparsed_identifier", None) for arg in args]
        if None in names:
            return None
        return getattr(expr, "_name", None), [(names[0], names[1])]
    match = _CALL.match(str(ranking))
    if not match:
        return None
    args = match.group(2)
    splits = [(args[:i], args[i + 2:]) for i in range(len(args)) if args.startswith(", ", i)]
    return match.group(1), splits


@contextlib.contextmanager
def _probing():
    """Analysis errors raised inside are expected answers, not failures to report.

    pyspark logs every analysis error that carries a DataFrame call site (an ``F.col``) at
    ERROR, with a stack trace, before raising it; a probe that finds a column missing on one
    side would print one on every call.
    """
    from pyspark.logger import PySparkLogger

    log = PySparkLogger.getLogger("DataFrameQueryContextLogger")
    was = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = was


def _resolves(df, ranking) -> bool:
    """Whether Spark's analyzer resolves ``ranking`` over ``df``'s columns."""
    try:
        with _probing():
            # Classic PySpark analyses select() eagerly; Connect when asked for a schema.
            df.select(ranking).schema
    except AnalysisException:
        return False
    return True


def _readings(splits, q_cols, t_cols) -> list[tuple[str, str]]:
    """(query column, target column) pairs the argument names allow, in either order."""
    out = []
    for first, second in splits:
        for a in _names(first):
            for b in _names(second):
                for qn, tn in ((a, b), (b, a)):
                    q_col, t_col = _find(qn, q_cols), _find(tn, t_cols)
                    if q_col is not None and t_col is not None:
                        out.append((q_col, t_col))
    return list(dict.fromkeys(out))


def _all_named_on(splits, cols) -> bool:
    """Whether both arguments, under some reading of their names, are columns of ``cols``:
    otherwise the ranking cannot resolve on that side and there is nothing to ask Spark."""
    return any(any(_find(a, cols) for a in _names(first)) and any(_find(b, cols) for b in _names(second))
               for first, second in splits)


def _on_both_sides_error(ranking, metric: str, readings) -> ValueError:
    (a, b) = readings[0]
    return ArgumentError(
        "ranking", f"{ranking}: its columns `{a}` and `{b}` resolve on both the query and the target "
        "(the same DataFrame on both sides, DataFrames derived from one another, or plain names "
        "present on both), so which one is the query's column cannot be known; Spark's "
        "nearestByJoin cannot tell them apart either. Name the columns per side: "
        f"nearest_by_join(query, target, {metric!r}, k, vectors=({a!r}, {b!r})) (query column "
        f"first), or alias the sides (q, t = df.alias('q'), df.alias('t')) and rank with "
        f"F.col('q.{_reference(a)}') and F.col('t.{_reference(b)}')"
    )


def _spark_vector_type(df, name: str) -> bool:
    """Whether Spark's vector functions take the column: ``array<float>`` only."""
    from pyspark.sql.types import ArrayType, FloatType

    dtype = df.schema.fields[column_index(df, name)].dataType
    return isinstance(dtype, ArrayType) and isinstance(dtype.elementType, FloatType)


def _connect_arguments(ranking) -> tuple | None:
    """A Spark Connect call's two arguments as Columns, each with the plan id that ties it to
    its DataFrame; None for a classic Column, whose arguments only its printed text shows."""
    if not type(ranking).__module__.startswith("pyspark.sql.connect"):
        return None
    return tuple(type(ranking)(arg) for arg in ranking._expr._args)


def _placements(text: str, argument, df, cols) -> list[str]:
    """The columns of ``df`` (one side) a ranking argument printed as ``text`` can be.

    The argument is resolved as a bare column reference, which Spark's analyzer places
    whatever its type, against ``df`` cut down to each column its names allow: under Connect
    the argument itself (``argument``: its plan id decides), in classic PySpark its printed
    name, where a qualified one (``a.v``, through an alias ``a``) resolves on its side only
    and a plain one on every side that has a column of that name."""
    from pyspark.sql import functions as F

    out = []
    for name in _names(text):
        col = _find(name, cols)
        if col is None or col in out:
            continue
        if argument is None and name == text:   # a plain name: nothing more to ask
            out.append(col)
            continue
        try:
            with _probing():   # classic PySpark resolves df[...] eagerly
                one = df.select(column(df, col))
        except AnalysisException:   # a name that is ambiguous under case-insensitive resolution
            continue
        if _resolves(one, argument if argument is not None else F.col(text)):
            out.append(col)
    return out


def _typed(df, name: str) -> str:
    return f"`{name}` ({df.schema.fields[column_index(df, name)].dataType.simpleString()})"


def _reading_by_placement(ranking, metric: str, splits, query, target) -> Ranking | None:
    """The ranking's columns when Spark's analyzer refuses its types (its vector functions
    take ``array<float>`` only; the join also takes ``array<double>`` and ``VectorUDT``).

    Each argument is placed on its own (:func:`_placements`). The ranking is the join's when
    one argument is a query column and the other a target column in exactly one way, and
    neither could instead be a second column of the other's side (the ranking may then be
    over one side, which is Spark's own join's). A reading over ``array<float>`` columns
    only is left out: the analyzer, which resolved none, would have resolved that one. The
    three functions are symmetric, so which argument came first does not matter.

    Raises
    ------
    ValueError
        Several readings: the error names them, the columns' types, and the two ways to say
        which column is which (``vectors=``, or qualified names through the sides' aliases).
    """
    q_cols, t_cols = list(query.columns), list(target.columns)
    arguments = _connect_arguments(ranking) or (None, None)
    cross, one_side = [], []
    for first, second in splits:
        (q1, t1), (q2, t2) = [(_placements(text, arg, query, q_cols), _placements(text, arg, target, t_cols))
                              for text, arg in zip((first, second), arguments)]
        cross += [(a, b) for a in q1 for b in t2] + [(b, a) for a in t1 for b in q2]
        # one column twice is the join's own reading of S against S, not a ranking of one side
        one_side += [("query", a, b) for a in q1 for b in q2 if a != b]
        one_side += [("target", a, b) for a in t1 for b in t2 if a != b]
    frames = {"query": query, "target": target}
    cross = [(a, b) for a, b in dict.fromkeys(cross)
             if not (_spark_vector_type(query, a) and _spark_vector_type(target, b))]
    one_side = [(side, a, b) for side, a, b in dict.fromkeys(one_side)
                if not (_spark_vector_type(frames[side], a) and _spark_vector_type(frames[side], b))]
    if len(cross) == 1 and not one_side:
        q_col, t_col = cross[0]
        vector_itemsize(query, q_col, "query")     # a column of no vector type: its own error
        vector_itemsize(target, t_col, "target")
        return Ranking(metric, q_col, t_col, str(ranking))
    if not cross:
        logger.debug("ranking %s: its arguments name no query column and target column", ranking)
        return None
    found = "; ".join([f"query {_typed(query, a)} and target {_typed(target, b)}" for a, b in cross]
                      + [f"{side} {_typed(frames[side], a)} and {side} {_typed(frames[side], b)}"
                         for side, a, b in one_side])
    a, b = cross[0]
    raise ArgumentError(
        "ranking", f"{ranking}: Spark's vector functions take array<float>, so Spark cannot place its "
        f"columns on a side, and their names fit several readings ({found}). Name the columns per "
        f"side with the metric name, which takes array<float>, array<double> and VectorUDT: "
        f"nearest_by_join(query, target, {metric!r}, k, vectors=({a!r}, {b!r})) (query column first), "
        f"or alias the sides (query.alias('q'), target.alias('t')) and rank with "
        f"F.col('q.{_reference(a)}') and F.col('t.{_reference(b)}')")


def parse_ranking(ranking, query, target, vectors=None) -> Ranking | None:
    """Read the metric and the vector columns of a ranking; None means "let Spark run it".

    Raises
    ------
    ValueError
        A metric name without usable ``vectors``, an unknown metric name, a vector column
        missing from its side, or a ranking over two different columns that both sides
        have in common (a DataFrame joined with itself), whose sides cannot be told apart;
        over ``array<double>`` or ``VectorUDT`` columns, arguments that fit several readings
        (:func:`_reading_by_placement`).
    TypeError
        A Column ranking placed by :func:`_reading_by_placement` on a column of no vector type
        (:func:`vector_itemsize`).
    """
    q_cols, t_cols = list(query.columns), list(target.columns)
    if isinstance(ranking, str):
        if ranking not in METRICS:
            raise ArgumentError("ranking", f"expected a vector function Column or one of {sorted(METRICS)}, "
                                           f"got {ranking!r}")
        if isinstance(vectors, str):
            q_name = t_name = vectors
        elif isinstance(vectors, (tuple, list)) and len(vectors) == 2 and all(isinstance(v, str) for v in vectors):
            q_name, t_name = vectors
        else:
            raise ArgumentError("vectors", "expected a column name present on both sides or a "
                                           "(query_column, target_column) pair when ranking is a "
                                           f"metric name, got {vectors!r}")
        q_col, t_col = _find(q_name, q_cols), _find(t_name, t_cols)
        if q_col is None:
            raise ArgumentError("vectors", f"query column {q_name!r} not found (query columns: {q_cols})")
        if t_col is None:
            raise ArgumentError("vectors", f"target column {t_name!r} not found (target columns: {t_cols})")
        return Ranking(ranking, q_col, t_col, ranking)

    if vectors is not None:
        raise ArgumentError("vectors", "only used with a metric-name ranking; the ranking Column names "
                                       f"its columns, got {vectors!r}")
    text = str(ranking)
    call = _call(ranking)
    if call is None or call[0] not in SPARK_FUNCTIONS:
        return None
    function, splits = call
    metric = SPARK_FUNCTIONS[function]
    readings = _readings(splits, q_cols, t_cols)
    if not readings:
        logger.debug("ranking %s: its arguments name no query column and target column", text)
        return None
    on_query = _all_named_on(splits, q_cols) and _resolves(query, ranking)
    on_target = _all_named_on(splits, t_cols) and _resolves(target, ranking)
    if on_query and on_target:
        # Every column of the ranking is a column of each side (in classic PySpark a
        # DataFrame joined with itself shares its attribute ids; Connect shares plan ids).
        # One column named twice has one reading: each row against the other side's rows.
        if len(readings) == 1 and readings[0][0] == readings[0][1]:
            return Ranking(metric, readings[0][0], readings[0][1], text)
        raise _on_both_sides_error(ranking, metric, readings)
    if on_query or on_target:
        # Both arguments resolve on one side: not one column of each side (or, in classic
        # PySpark, sides sharing attribute ids, where Spark's own rules decide): Spark's.
        logger.debug("ranking %s: all its columns resolve on the %s alone", text,
                     "query" if on_query else "target")
        return None
    # Neither side alone resolves the ranking, so a reading under which it resolves over the
    # two one-column sides takes one argument from each: exactly that query column and that
    # target column.
    held = []
    for q_col, t_col in readings:
        try:
            with _probing():  # classic PySpark resolves df[...] eagerly
                pair = query.select(column(query, q_col)).crossJoin(target.select(column(target, t_col)))
        except AnalysisException:  # a name that is ambiguous under case-insensitive resolution
            continue
        if _resolves(pair, ranking):
            held.append((q_col, t_col))
    if len(held) == 1:
        return Ranking(metric, held[0][0], held[0][1], text)
    if not held and not all(_spark_vector_type(query, q) and _spark_vector_type(target, t) for q, t in readings):
        # Nothing resolved, and a column the names allow is one Spark's vector functions refuse:
        # the analyzer stopped at the types before it placed a column on a side.
        return _reading_by_placement(ranking, metric, splits, query, target)
    logger.debug("ranking %s: %d readings resolve as one query and one target column", text, len(held))
    return None


# A reference no column has, of two parts: for a qualified name Spark's suggestions spell out
# the candidates' qualifiers, which it leaves out for a plain name.
_NO_SUCH_COLUMN = "`__nearest_join_no_table`.`__nearest_join_no_column`"


def qualifier(df, name: str) -> str | None:
    """The qualifier Spark's analyzer gives the column ``name`` of ``df``: the DataFrame's alias
    (``S.alias("a")``), a table's or view's name; None when it has none.

    No DataFrame method tells it, and under Spark Connect no plan is at hand, so the analyzer is
    asked: a reference to no column of ``df`` cut down to that one column fails with
    ``UNRESOLVED_COLUMN.WITH_SUGGESTION``, whose ``proposal`` is that column's qualified name.
    An answer of another shape is read as no qualifier.

    A classic DataFrame has its analyzed plan at hand: the column's attribute tells its
    qualifier in a few gateway calls, where the failed analysis costs hundreds.
    """
    from pyspark.sql import functions as F

    jdf = getattr(df, "_jdf", None)
    if jdf is not None:
        parts = jdf.queryExecution().analyzed().output().apply(column_index(df, name)).qualifier()
        return None if parts.isEmpty() else parts.last()
    try:
        with _probing():
            df.select(column(df, name)).select(F.col(_NO_SUCH_COLUMN)).schema
    except AnalysisException as exc:
        parts = _name_parts((exc.getMessageParameters() or {}).get("proposal", ""))
        if parts and len(parts) >= 2 and parts[-1] == name:
            return parts[-2]
    return None


def side_qualifiers(query, target, parsed: Ranking) -> tuple[str | None, str | None]:
    """The qualifiers of the query's and the target's vector columns (:func:`qualifier`), which
    the join's output gives each side's columns, as Spark's own join keeps its sides' qualifiers:
    after a self-join through ``S.alias("a")`` and ``S.alias("b")``, ``a.id`` and ``b.id`` are the
    two ``id`` columns, however the ranking named the vectors (the metric-name form too)."""
    return qualifier(query, parsed.query_column), qualifier(target, parsed.target_column)


# ----------------------------------------------------------------------------- on= keys
@dataclass(frozen=True)
class JoinKey:
    """One key of ``on=``: a query column equal to a target column, compared in ``common``
    (the type Spark's equality casts both to, as a simple string)."""

    query_column: str
    target_column: str
    query_type: str
    target_type: str
    common: str


def _equality_terms(text: str) -> list[list[tuple[str, str]]]:
    """Readings of a classic Column's prefix text (``=(a, b)``, ``and(X, Y)``) as an AND of
    equalities: each a list of (first argument text, second argument text). A name holding
    ", " or parentheses makes a split ambiguous: every split is returned, the analyzer picks."""
    out = []
    for head, combine in (("=(", False), ("and(", True)):
        if not (text.startswith(head) and text.endswith(")")):
            continue
        inner = text[len(head):-1]
        for i in range(len(inner)):
            if not inner.startswith(", ", i):
                continue
            left, right = inner[:i], inner[i + 2:]
            if not combine:
                out.append([(left, right)])
                continue
            for a in _equality_terms(left):
                for b in _equality_terms(right):
                    out.append(a + b)
    return out


def _connect_terms(expr) -> list[list[tuple[str, str]]]:
    """The same readings from a Spark Connect Column's expression tree (exact)."""
    name, args = getattr(expr, "_name", None), getattr(expr, "_args", None)
    if args is None or len(args) != 2:
        return []
    if name == "==":
        names = [getattr(arg, "_unparsed_identifier", None) for arg in args]
        return [] if None in names else [[(names[0], names[1])]]
    if name == "and":
        return [a + b for a in _connect_terms(args[0]) for b in _connect_terms(args[1])]
    return []


def _column_keys(on, query, target) -> list[tuple[str, str]]:
    """(query column, target column) pairs of a Column equality (or ``&`` of them), each
    side placed by Spark's analyzer as :func:`parse_ranking` places a ranking's columns."""
    import itertools

    expected = ("expected an equality between one query column and one target column "
                "(q.a == t.b), or & of such equalities")
    if type(on).__module__.startswith("pyspark.sql.connect"):
        decompositions = _connect_terms(getattr(on, "_expr", None))
    else:
        match = re.match(r"^Column<'(.*)'>$", str(on), re.DOTALL)
        decompositions = _equality_terms(match.group(1)) if match else []
    if not decompositions:
        raise ArgumentError("on", f"{expected}, got {on}")
    q_cols, t_cols = list(query.columns), list(target.columns)
    on_query, on_target = _resolves(query, on), _resolves(target, on)
    if on_query or on_target:
        where = "both the query and the target" if on_query and on_target else (
            "the query alone" if on_query else "the target alone")
        raise ArgumentError("on", f"{expected}, got {on}, whose columns all resolve on {where} "
                                  "(with one DataFrame on both sides, alias the sides: "
                                  "F.col('q.a') == F.col('t.b'))")
    held = []
    for terms in decompositions:
        options = [_readings([term], q_cols, t_cols) for term in terms]
        for combo in itertools.product(*options):
            q_names = list(dict.fromkeys(q for q, _ in combo))
            t_names = list(dict.fromkeys(t for _, t in combo))
            try:
                with _probing():
                    pair = query.select(*[column(query, n) for n in q_names]).crossJoin(
                        target.select(*[column(target, n) for n in t_names]))
            except AnalysisException:
                continue
            if _resolves(pair, on):
                held.append(tuple(combo))
    held = list(dict.fromkeys(held))
    if len(held) != 1:
        found = "no reading" if not held else f"{len(held)} readings"
        raise ArgumentError("on", f"{expected}, got {on}: {found} of its columns as one query "
                                  f"column and one target column per equality resolves "
                                  f"(query columns: {q_cols}, target columns: {t_cols})")
    return list(held[0])


def parse_keys(on, query, target) -> list[JoinKey]:
    """Resolve ``on`` (as :class:`~nearest_join.options.JoinOptions` normalised it: name
    pairs or a Column) against both sides and type its keys.

    Each pair is compared the way Spark's SQL equality compares it: both sides are cast to
    the common type Spark's analyzer chooses (``int`` and ``bigint`` as ``bigint``, ``date``
    and ``timestamp`` as ``timestamp``, a string and a number as a number).

    Raises
    ------
    ValueError
        A column missing from its side (the message lists the side's columns), a Column that
        is not an equality between one query and one target column (or ``&`` of them), or a
        key type Spark cannot compare for equality (a map; a boolean with a number).
    """
    from pyspark.sql import functions as F

    q_cols, t_cols = list(query.columns), list(target.columns)
    if isinstance(on, tuple):
        pairs = []
        for q_name, t_name in on:
            q_col, t_col = _find(q_name, q_cols), _find(t_name, t_cols)
            if q_col is None:
                raise ArgumentError("on", f"query column {q_name!r} not found (query columns: {q_cols})")
            if t_col is None:
                raise ArgumentError("on", f"target column {t_name!r} not found (target columns: {t_cols})")
            pairs.append((q_col, t_col))
    else:
        pairs = _column_keys(on, query, target)
    keys = []
    for q_col, t_col in pairs:
        q_type = query.schema.fields[column_index(query, q_col)].dataType.simpleString()
        t_type = target.schema.fields[column_index(target, t_col)].dataType.simpleString()
        pair = query.select(column(query, q_col).alias("q")).crossJoin(
            target.select(column(target, t_col).alias("t")))
        try:
            with _probing():
                # The equality checks that Spark can compare the two; coalesce's result type is
                # the common type that equality casts both sides to.
                schema = pair.select((F.col("q") == F.col("t")).alias("e"), F.coalesce("q", "t").alias("c")).schema
        except AnalysisException as exc:
            first = str(exc).strip().splitlines()[0]
            raise ArgumentError("on", f"expected key columns Spark can compare for equality, got query "
                                      f"column {q_col!r} of type {q_type} and target column {t_col!r} "
                                      f"of type {t_type} ({first})") from None
        keys.append(JoinKey(q_col, t_col, q_type, t_type, schema["c"].dataType.simpleString()))
    return keys
