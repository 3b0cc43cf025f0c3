"""``python -m jobs run JOB.yaml``: the ``nearest-join`` command without the console script."""
import sys

from jobs.cli import main

sys.exit(main())
