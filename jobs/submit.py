"""``spark-submit [options] jobs/submit.py JOB.yaml [--set KEY=VALUE ...]``.

The same code path as ``nearest-join run``; ``spark-submit``'s ``--master`` and ``--conf``
settings win over the spec's ``master``. Any ``nearest-join`` subcommand works too, e.g.
``spark-submit jobs/submit.py explain JOB.yaml``.
"""
import os
import sys

if __name__ == "__main__":
    # spark-submit puts this file's folder (jobs/) on sys.path, not the project root.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jobs.cli import main

    argv = sys.argv[1:]
    if not argv or argv[0] not in ("run", "explain", "demo", "-h", "--help"):
        argv = ["run", *argv]
    sys.exit(main(argv, submitted=True))
