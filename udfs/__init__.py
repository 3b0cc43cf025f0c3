"""Executor side: Arrow batch loops that feed blocks to a kernel and emit top-k rows.

Nothing here imports pyspark at module level: these functions run inside Spark's Python
workers, and also outside Spark (tests and GPU benchmarks feed them ``pyarrow.RecordBatch``es
directly).
"""
