"""udfs.daemon: the executors' worker daemon puts an installed pyspark of the zip's version
before Spark's pyspark.zip (whose modules every process would compile again), and only then."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from udfs import daemon


def _spark_path(tmp_path, zip_version: str, installed_version: str):
    archive = tmp_path / "lib" / "pyspark.zip"
    archive.parent.mkdir()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("pyspark/version.py", f'__version__: str = "{zip_version}"\n')
    site = tmp_path / "site-packages"
    (site / "pyspark").mkdir(parents=True)
    (site / "pyspark" / "version.py").write_text(f'__version__: str = "{installed_version}"\n')
    (site / "pyspark" / "__init__.py").write_text("")
    return [str(archive), str(tmp_path / "lib" / "py4j.zip"), str(site)]


@pytest.mark.parametrize("installed, moved", [("4.3.0", True), ("4.2.1", False)])
def test_installed_pyspark_goes_first_only_at_the_zip_s_version(tmp_path, monkeypatch, installed, moved):
    path = _spark_path(tmp_path, "4.3.0", installed)
    monkeypatch.setattr(sys, "path", list(path))
    monkeypatch.delitem(sys.modules, "pyspark", raising=False)
    assert daemon.prefer_installed_pyspark() is moved
    assert sys.path == ([path[2], path[0], path[1]] if moved else path)


def test_nothing_moves_once_pyspark_is_imported(tmp_path, monkeypatch):
    path = _spark_path(tmp_path, "4.3.0", "4.3.0")
    monkeypatch.setattr(sys, "path", list(path))
    monkeypatch.setitem(sys.modules, "pyspark", object())
    assert daemon.prefer_installed_pyspark() is False and sys.path == path


def test_a_worker_s_first_search_finds_its_imports_and_numba_set_up():
    """After the daemon's preload (what a forked worker inherits), a first search that loads
    its kernels from numba's cache sets up no numba registry and imports no part of scipy
    (numba's BLAS binding): what took most of a worker's first search happened once, before
    the fork. (numba may still import a small module of its own on a first call.)"""
    script = textwrap.dedent("""
        import json, sys, numpy as np
        from udfs import daemon
        daemon._preload()
        from numba.core.registry import cpu_target
        from nearest_kernels import knn
        before = set(sys.modules)
        registries = len(cpu_target.typing_context._registries)
        rng = np.random.default_rng(0)
        knn(rng.standard_normal((50, 8)).astype(np.float32), rng.standard_normal((300, 8)).astype(np.float32),
            5, "l2", backend="cpu")
        print(json.dumps({"scipy": sorted(m for m in set(sys.modules) - before if m.split(".")[0] == "scipy"),
                          "registries": len(cpu_target.typing_context._registries) - registries}))
    """)
    # The same search here first: its kernels are then in numba's cache of the suite's
    # processes (compiled here, or loaded from it), which the new process loads.
    import numpy as np

    from nearest_kernels import knn

    rng = np.random.default_rng(0)
    knn(rng.standard_normal((50, 8)).astype(np.float32), rng.standard_normal((300, 8)).astype(np.float32),
        5, "l2", backend="cpu")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"scipy": [], "registries": 0}, found
