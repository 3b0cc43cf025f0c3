"""Scheduled entry points: parse a YAML job spec, call the library, publish the result.

``nearest-join run JOB.yaml`` (console script, :func:`jobs.cli.main`), ``python -m jobs`` and
``spark-submit jobs/submit.py JOB.yaml`` all take the same code path:
:mod:`jobs.spec` (load and validate) -> :mod:`jobs.runner` (lock the output, check the
Parquet files with :mod:`jobs.inputs`, read, plan, join, write) -> :mod:`jobs.output`
(atomic publication). No join logic lives here.
"""
