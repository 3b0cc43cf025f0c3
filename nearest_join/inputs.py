"""The two sides as the executors read them: positional column names and, with ``on=`` keys,
a dense group id per row.

Every plan maps its inputs through :func:`positional_inputs` (``nearest_join.join``), and the
planners that count the groups before the join runs (the keyed blocked layout, the ``on=``
keys' IVF lists in ``nearest_join.ivf_keys``) read the same frames, so the group ids they
count are the ones the join searches.
"""
from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from udfs import columns as C

from .ranking import column_index


def positional_inputs(query: DataFrame, target: DataFrame, keys) -> tuple[DataFrame, DataFrame]:
    """Both sides with plain positional column names (those of the columns' output
    positions) and, with ``on=`` keys, each side's group id last (:func:`_with_groups`).

    mapInArrow passes its input to the UDF as df[name] for every column name, and Spark
    parses those (a dot is a field access, a backtick a syntax error): the mapped inputs get
    plain names. Only positions matter to the executors.
    """
    n_query = len(query.columns)
    q_input = query.toDF(*[C.output_name(i) for i in range(n_query)])
    t_input = target.toDF(*[C.output_name(n_query + j) for j in range(len(target.columns))])
    if keys is None:
        return q_input, t_input
    return _with_groups(q_input, t_input, keys,
                        [C.output_name(column_index(query, k.query_column)) for k in keys],
                        [C.output_name(n_query + column_index(target, k.target_column)) for k in keys])


def _with_groups(q_input: DataFrame, t_input: DataFrame, keys, q_names: list[str],
                 t_names: list[str]) -> tuple[DataFrame, DataFrame]:
    """Both sides with a dense int group id (``C.GROUP``) per distinct non-NULL target key.

    The keys are cast to their common type (as Spark's ``=`` compares them) and the distinct
    target keys numbered 0..G-1 in key order (deterministic: the same ids however often
    Spark evaluates it). The target keeps the rows whose key has an id (a NULL key matches
    nothing); the query keeps every row, with a NULL id where its key has no group. The ids
    are the keyed plan's only notion of a key, so any grouping (an IVF list id) can take
    their place.
    """
    from pyspark.sql import Window

    names = [C.key_name(i) for i in range(len(keys))]

    def keyed(df: DataFrame, sources: list[str]) -> DataFrame:
        return df.select("*", *[F.col(src).cast(k.common).alias(n) for src, k, n in zip(sources, keys, names)])

    t_keyed = keyed(t_input, t_names)
    groups = (t_keyed.select(*names).where(" AND ".join(f"{n} IS NOT NULL" for n in names)).distinct()
              .withColumn(C.GROUP, (F.row_number().over(Window.orderBy(*names)) - 1).cast("int")))
    t_out = t_keyed.join(F.broadcast(groups), names, "inner").select(*t_input.columns, C.GROUP)
    q_out = keyed(q_input, q_names).join(F.broadcast(groups), names, "left").select(*q_input.columns, C.GROUP)
    return q_out, t_out
