"""The demo dataset: deterministic query and target tables of vectors with an id/name payload.

``nearest-join demo`` writes ``DATA_DIR/query`` and ``DATA_DIR/target`` (Parquet, ``vec`` as
``array<float>``) if they are absent or were generated with other sizes, then runs
``conf/demo.yaml`` on them. The vectors are drawn around a few dozen cluster centres so that
nearest neighbours mean something (a query's neighbours come from its own cluster).

Written with pyarrow, not Spark: generating data is not the job being demonstrated, and it
keeps the demo's Spark time for the join.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from nearest_join.publish import replace_directory

from .spec import SpecError

logger = logging.getLogger(__name__)

MANIFEST = "_demo_manifest.json"
_FILES_PER_TABLE = 4  # a few files, so that Spark reads each table in several partitions


@dataclass(frozen=True)
class DemoSize:
    query_rows: int = 2_000
    target_rows: int = 20_000
    dimension: int = 64
    clusters: int = 40
    seed: int = 20_240_601
    version: int = 1


def _table(prefix: str, ids: np.ndarray, vectors: np.ndarray):
    import pyarrow as pa

    dimension = vectors.shape[1]
    offsets = pa.array(np.arange(0, (len(ids) + 1) * dimension, dimension, dtype=np.int32))
    return pa.table({
        "id": pa.array(ids, type=pa.int64()),
        "name": pa.array([f"{prefix}-{i:06d}" for i in ids]),
        "vec": pa.ListArray.from_arrays(offsets, pa.array(vectors.reshape(-1), type=pa.float32())),
    })


def _write_table(directory: Path, table) -> None:
    import pyarrow.parquet as pq

    directory.mkdir(parents=True)
    bounds = np.linspace(0, table.num_rows, _FILES_PER_TABLE + 1).astype(int)
    for part, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        pq.write_table(table.slice(lo, hi - lo), directory / f"part-{part:05d}.parquet")


def generate(size: DemoSize) -> dict[str, np.ndarray]:
    """The demo vectors: ``{"query": (nq, d), "target": (nt, d)}`` float32, deterministic."""
    rng = np.random.default_rng(size.seed)
    centres = rng.normal(0.0, 1.0, (size.clusters, size.dimension))
    tables = {}
    for name, rows in (("query", size.query_rows), ("target", size.target_rows)):
        members = rng.integers(0, size.clusters, rows)
        noise = rng.normal(0.0, 0.35, (rows, size.dimension))
        tables[name] = (centres[members] + noise).astype(np.float32)
    return tables


def ensure_demo_data(data_dir: str | os.PathLike, size: DemoSize = DemoSize()) -> Path:
    """Write the demo tables under ``data_dir`` unless the same size is already there.

    The directory is built beside its final place and swapped in whole, so an interrupted
    generation never leaves a half-written demo table.
    """
    data_dir = Path(data_dir).resolve()
    manifest = data_dir / MANIFEST
    if manifest.is_file():
        try:
            if json.loads(manifest.read_text()) == asdict(size):
                logger.info("demo data present in %s", data_dir)
                return data_dir
        except ValueError:
            pass
    elif data_dir.is_dir() and any(data_dir.iterdir()):
        raise SpecError(
            "--data-dir",
            f"{str(data_dir)!r} holds files that are not demo data (no {MANIFEST}); "
            "choose another --data-dir",
        )
    logger.info(
        "generating demo data in %s: %d query x %d target vectors, d=%d",
        data_dir, size.query_rows, size.target_rows, size.dimension,
    )
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = data_dir.parent / f".{data_dir.name}.nj-staging-{uuid.uuid4().hex[:12]}"
    try:
        for name, vectors in generate(size).items():
            ids = np.arange(len(vectors), dtype=np.int64)
            _write_table(staging / name, _table(name, ids, vectors))
        (staging / MANIFEST).write_text(json.dumps(asdict(size), indent=2) + "\n")
        replace_directory(staging, data_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return data_dir


def demo_overrides(data_dir: Path) -> list[str]:
    """``--set`` overrides pointing conf/demo.yaml at ``data_dir``."""
    return [f"query.path={data_dir / 'query'}", f"target.path={data_dir / 'target'}"]


def sample_output(spark, path: str, rows: int = 10):
    """The first ``rows`` output rows by query id and rank, as a pandas DataFrame."""
    df = spark.read.parquet(path)
    order = [c for c in ("id", "distance") if c in df.columns] or df.columns[:1]
    return df.orderBy(*order).limit(rows).toPandas()
