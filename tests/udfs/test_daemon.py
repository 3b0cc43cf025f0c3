"""udfs.daemon: the executors' worker daemon puts an installed pyspark of the zip's version
before Spark's pyspark.zip (whose modules every process would compile again), and only then."""
from __future__ import annotations

import sys
import zipfile

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
