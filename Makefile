# Two commands do all set-up on a fresh machine:
#   make run   - create .venv if needed, install, run the demo job (local-mode Spark)
#   make test  - create/update .venv with the test dependencies, run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch lies on this machine's disk; a plain `torch` would pull a multi-GB
# CUDA build. triton is only used here through TRITON_INTERPRET=1 (kernel tests on the CPU).
TORCH_CPU := torch==2.13.0
TRITON := triton==3.6.0

.PHONY: run test check-java bench-cpu bench-spark bench-report clean

# Some machines set PYTHONDONTWRITEBYTECODE: every process (Spark's Python workers included)
# would then compile each module it imports from source again. Empty, Python writes the
# bytecode on a module's first import and later processes load it.
export PYTHONDONTWRITEBYTECODE :=

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile -e .
	@touch $@

# One pip run for the package, its test extras, torch and triton: one resolution, one build
# (this is the set-up `make test` pays on a fresh clone, inside its time budget).
# --no-compile: pip would byte-compile all of every package (torch alone is thousands of
# modules), most of which no process imports. This Makefile's commands write the bytecode of
# what they import instead, once (PYTHONDONTWRITEBYTECODE above).
$(VENV)/.installed-dev: pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-compile $(TORCH_CPU) $(TRITON) -e '.[dev]'
	@touch $(VENV)/.installed $@

check-java:
	@command -v java >/dev/null 2>&1 || { echo "Java 17+ is required by pyspark 4.x. Install it, e.g.: sudo apt-get install -y openjdk-17-jre-headless" >&2; exit 1; }
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	  if [ -z "$$v" ] || [ "$$v" -lt 17 ]; then echo "Java 17+ is required by pyspark 4.x (found: $$v). Install it, e.g.: sudo apt-get install -y openjdk-17-jre-headless" >&2; exit 1; fi

# jobs.jvm records Spark's class archive once per pyspark install (a local job's JVM then starts
# from it); it returns at once when the archive is there.
run: $(VENV)/.installed check-java
	$(PY) -m jobs.jvm
	PYSPARK_PYTHON=$(abspath $(PY)) $(VENV)/bin/nearest-join demo

# --durations=15: the slowest tests in every run's output (CI included), to see where time goes.
test: $(VENV)/.installed-dev check-java
	PYSPARK_PYTHON=$(abspath $(PY)) $(PY) -m pytest -q --durations=15

bench-cpu: $(VENV)/.installed-dev
	$(PY) benchmarks/cpu_kernel.py

bench-spark: $(VENV)/.installed-dev check-java
	PYSPARK_PYTHON=$(abspath $(PY)) $(PY) benchmarks/spark_join.py

# RESULTS.md's tables and plots/*.png from the benchmarks' records in benchmarks/results/.
bench-report: $(VENV)/.installed-dev
	$(PY) benchmarks/report.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
