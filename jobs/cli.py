"""``nearest-join``: run, explain or demo a nearest-neighbour join job from a YAML spec.

Exit status: 0 success; 2 bad spec or input (the message names the key, column or file, and
nothing was written); 1 anything else (the message says what to do; the previous output is
untouched and the same command can simply be re-run).

The same code path serves ``spark-submit`` (see ``jobs/submit.py``); there the session is
built by this process too, but ``--master`` and friends come from ``spark-submit``.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import traceback

from .spec import SpecError, check_paths, conf_dir, load_spec

logger = logging.getLogger("jobs.cli")

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
_LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (tests and notebooks replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _configure_logging(level: int) -> None:
    """Log jobs.* and nearest_join.* to stderr once per process (main may run many times)."""
    for name in ("jobs", "nearest_join"):
        log = logging.getLogger(name)
        log.setLevel(level)
        if not any(getattr(h, "_nearest_join_cli", False) for h in log.handlers):
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter(_LOG_FORMAT, "%H:%M:%S"))
            handler._nearest_join_cli = True  # type: ignore[attr-defined]
            log.addHandler(handler)
            # The root logger may have its own handlers (pytest, an orchestrator): ours is
            # the console, so do not print twice through the root.
            log.propagate = False


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a spec key, e.g. --set join.k=10 --set output.path=/tmp/out "
             "--set spark.spark.sql.shuffle.partitions=64 (values are YAML scalars)",
    )


def _add_param(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--param", action="append", default=[], metavar="NAME=VALUE",
        help="a run parameter, written ${NAME} in the spec's strings, e.g. --param run_date=2026-12-03 "
             "(run_date defaults to today, UTC)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nearest-join",
        description="Exact nearest-neighbour joins of Parquet tables on Spark, from a YAML job spec.",
        epilog="Exit status: 0 success, 2 bad spec or input (nothing written), 1 other failure.",
    )
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    verbosity.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run a job spec and publish its output atomically")
    run.add_argument("spec", help="the job spec (YAML)")
    _add_set(run)
    _add_param(run)
    run.set_defaults(handler=_run)

    explain = commands.add_parser("explain", help="print the plan a job would take, run nothing")
    explain.add_argument("spec", help="the job spec (YAML)")
    explain.add_argument("--json", action="store_true", help="print the plan as JSON")
    _add_set(explain)
    _add_param(explain)
    explain.set_defaults(handler=_explain)

    demo = commands.add_parser("demo", help="generate the demo data if absent and run conf/demo.yaml")
    demo.add_argument("--data-dir", default="data/demo", help="demo tables (default: data/demo)")
    demo.add_argument("--query-rows", type=int, default=2_000)
    demo.add_argument("--target-rows", type=int, default=20_000)
    demo.add_argument("--dimension", type=int, default=64)
    _add_set(demo)
    demo.set_defaults(handler=_demo)
    return parser


def _session(spec, submitted: bool):
    from .runner import spark_session

    return spark_session(spec.spark_settings, app_name=f"nearest-join {spec.name}",
                         use_master=not submitted)


def _run(args, submitted: bool) -> int:
    from .runner import format_summary, run_job, start_kernel_warm_up

    spec = load_spec(args.spec, args.set, args.param)
    args.output_path = spec.output.target
    check_paths(spec)  # before Spark starts: a missing input fails in a second, not a minute
    start_kernel_warm_up(spec, submitted)
    with _session(spec, submitted) as spark:
        summary = run_job(spec, spark)
    print(format_summary(summary))
    return EXIT_OK


def _explain(args, submitted: bool) -> int:
    from .runner import explain_job

    spec = load_spec(args.spec, args.set, args.param)
    check_paths(spec)
    if spec.incremental is not None:
        return _explain_refresh(spec, args, submitted)
    with _session(spec, submitted) as spark:
        prepared, table = explain_job(spec, spark)
    described = prepared.plan.to_dict()
    output = table.describe() if table is not None else [spec.output.path]
    if args.json:
        described["job"] = {"parameters": spec.parameters,
                            "inputs": {s.side: s.source for s in (spec.query, spec.target)},
                            "output": output, "partition_values": dict(spec.output.partition_values)}
        print(json.dumps(described, indent=2, sort_keys=True, default=str))
        return EXIT_OK
    print(f"nearest-join: job {spec.name!r} ({spec.source}) would run:")
    if spec.parameters:
        print("  params  " + ", ".join(f"{k}={v}" for k, v in sorted(spec.parameters.items())))
    for side, rows in ((spec.query, prepared.query_rows), (spec.target, prepared.target_rows)):
        where = f" where {side.where}" if side.where else ""
        print(f"  {side.side:<7} {rows:,} rows <- {side.source}{where}")
    values = ", ".join(f"{k}={v}" for k, v in spec.output.partition_values)
    print(f"  output  {output[0]} (mode {spec.output.mode}"
          + (f"; this run's partition values: {values}" if values else "") + ")")
    for line in output[1:]:
        print(f"  {line}")
    print(str(prepared.plan))
    return EXIT_OK


def _explain_refresh(spec, args, submitted: bool) -> int:
    """``explain`` of an ``incremental`` spec: what the next run would refresh (or why it would
    be a full run), from the inputs and the state in the output."""
    import dataclasses

    from .runner import explain_refresh

    with _session(spec, submitted) as spark:
        plan = explain_refresh(spec, spark)
    if args.json:
        print(json.dumps(dataclasses.asdict(plan), indent=2, sort_keys=True))
        return EXIT_OK
    print(f"nearest-join: job {spec.name!r} ({spec.source}) would run:")
    if spec.parameters:
        print("  params  " + ", ".join(f"{k}={v}" for k, v in sorted(spec.parameters.items())))
    print(f"  query   <- {spec.query.source}")
    print(f"  target  <- {spec.target.source}")
    print(f"  output  {spec.output.path} (mode {spec.output.mode})")
    print(str(plan))
    return EXIT_OK


def _demo(args, submitted: bool) -> int:
    from .demo import DemoSize, demo_overrides, ensure_demo_data, sample_output
    from .runner import format_summary, run_job, start_kernel_warm_up

    for flag in ("query_rows", "target_rows", "dimension"):
        if getattr(args, flag) < 1:
            raise SpecError(f"--{flag.replace('_', '-')}", f"must be >= 1, got {getattr(args, flag)}")
    size = DemoSize(args.query_rows, args.target_rows, args.dimension)
    data_dir = ensure_demo_data(args.data_dir, size)
    spec = load_spec(conf_dir() / "demo.yaml", demo_overrides(data_dir) + args.set)
    args.output_path = spec.output.path
    check_paths(spec)
    start_kernel_warm_up(spec, submitted)
    with _session(spec, submitted) as spark:
        summary = run_job(spec, spark)
        sample = sample_output(spark, spec.output.path)
    print(format_summary(summary))
    print(f"\nfirst {len(sample)} output rows (by query id, nearest first):")
    print(sample.to_string(index=False))
    return EXIT_OK


def main(argv: list[str] | None = None, *, submitted: bool = False) -> int:
    """Entry point of the ``nearest-join`` console script; returns the exit status.

    ``submitted`` is set by ``jobs/submit.py``: the job runs under ``spark-submit``, whose
    ``--master`` wins over the spec's.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error (argparse uses status 2)
        return int(exc.code or 0)
    _configure_logging(
        logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    )
    args.output_path = None
    try:
        return args.handler(args, submitted)
    except SpecError as exc:
        print(f"nearest-join: error: {exc}", file=sys.stderr)
        print("nearest-join: nothing was written; fix the spec or the input and re-run.",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("nearest-join: interrupted; the previous output, if any, is untouched.",
              file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
        traceback.print_exc(file=sys.stderr)
        where = f" at {args.output_path}" if args.output_path else ""
        print(f"nearest-join: failed: {_cause(exc)}", file=sys.stderr)
        if "ModuleNotFoundError" in str(exc):
            print("nearest-join: the Spark workers' Python cannot import the package: install "
                  "nearest-join in the executors' Python environment (or ship it with "
                  "--py-files / --archives) and set spark.pyspark.python to it.", file=sys.stderr)
        print(
            f"nearest-join: the previous output{where}, if any, is untouched. Fix the cause "
            "shown above (see the Spark log for executor errors) and re-run the same "
            "command; re-running is safe.",
            file=sys.stderr,
        )
        return EXIT_FAILED


_ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Exit)): ")


def _cause(exc: BaseException) -> str:
    """One line: the innermost ``SomethingError: message`` of a (Python worker) traceback."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    inner = [line for line in lines if _ERROR_LINE.match(line)]
    text = inner[-1] if inner else (lines[0] if lines else "")
    return f"{type(exc).__name__}: {text}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
