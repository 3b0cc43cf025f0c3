"""Executor side: Arrow batch loops that feed blocks to a kernel and emit top-k rows.

Every plan packs each side's rows into blocks first; then a block pair's data runs one way,

    decode  ->  search  ->  merge  ->  encode

(blobs and columns to arrays, the pair's top-k, the query block's running top-k folded and
merged, the joined rows as Arrow), driven by the loops Spark runs (``blocks``). The modules,
each importing only modules listed above it:

==============  ==============================================================================
``columns``     internal column names and bit layouts (shared with the driver)
``context``     what the driver hands a task (settings, layouts) and what the task has (cores,
                partition, GPU, stage)
``decode``      Arrow in: blobs, binary, vector and group columns -> tables and numpy arrays
``packing``     user rows -> packed blocks, one Arrow IPC blob each
``files``       a side's rows read from its Parquet files in the task, not handed over by Spark
``payload``     payload rows gathered from their tables (for the merge and the encoding)
``gpu_memory``  what a GPU searcher holds: host staging, resident and kept target blocks
``gpu_search``  the GPU searcher and its device-side fold
``search``      a block pair's top-k: the task's searcher (CPU, or the GPU's), keyed search
``merge``       a query block's running top-k: fold, merge of partials, wire format
``encode``      Arrow out: a query block's joined rows as the batches Spark receives
``ivf``         the IVF plan's passes: rows routed to their lists and packed, the recall scan
``blocks``      the plan loops Spark runs (``mapInArrow``, ``applyInArrow``)
``local``       the same loops in-process, without Spark (tests, benchmarks)
``warm``        the CPU kernels compiled off the critical path, once per process
``daemon``      Spark's Python worker daemon for executors (``spark.python.daemon.module``)
==============  ==============================================================================

Nothing here imports pyspark at module level: these functions run inside Spark's Python
workers, and also outside Spark (tests and GPU benchmarks feed them ``pyarrow.RecordBatch``es
directly).
"""
