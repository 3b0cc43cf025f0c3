"""Job specs: one YAML file describes one nearest-neighbour join, validated before anything runs.

A spec names the query and target inputs (Parquet, ORC or JSON paths, or catalog tables), the vector columns, the ranking (metric, k,
mode, join type), the output (path, partitioning, write mode) and the Spark settings. Every
problem is reported as a :class:`SpecError` naming the key (``join.k``, ``query.path``), so the
CLI can exit with status 2 before it reads or writes any data.

The YAML is read with a safe loader (no Python objects, no code) that also refuses duplicate
keys, which a plain ``yaml.safe_load`` would silently resolve to the last one.

Spark settings come in layers, later ones win: the profile named by ``spark_profile`` (a file
in ``conf/``, ``local`` by default), the spec's ``spark`` mapping, then ``--set spark.KEY=VALUE``.

Relative paths are resolved against the current working directory (as ``spark-submit`` does),
so a cron line should ``cd`` to the project first or the spec should use absolute paths.
"""
from __future__ import annotations

import copy
import datetime as dt
import difflib
import fnmatch
import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from nearest_join.errors import describe, short
from nearest_join.options import JoinOptions

from .params import ParameterError, parse_params, substitute

__all__ = [
    "SpecError",
    "InputSpec",
    "JoinSpec",
    "OutputSpec",
    "JobSpec",
    "WRITE_MODES",
    "INPUT_FORMATS",
    "catalog_settings",
    "SUMMARY_FILE",
    "load_spec",
    "load_profile",
    "parse_spec",
    "parse_override",
    "apply_overrides",
    "check_paths",
    "check_output_target",
    "check_output_writable",
    "redact_settings",
    "conf_dir",
]

WRITE_MODES = ("overwrite", "error-if-exists", "overwrite_partitions")
# What a path input can be read as (spark.read.format); a table is read as the catalog says.
INPUT_FORMATS = ("parquet", "orc", "json")
# ``output.schema_change``: what a run does when its result's columns differ from its table's.
SCHEMA_CHANGES = ("error", "add_columns")
# Written by jobs.output beside the Parquet files; its presence marks a directory as ours.
SUMMARY_FILE = "_nearest_join_summary.json"

_REQUIRED = object()

# The accepted keys and their defaults. Unknown keys are errors (a typo such as ``join.kk``
# must not silently fall back to a default).
_SIDE_KEYS: dict[str, Any] = {
    "path": None,          # file, directory or glob, or a list of them; or:
    "table": None,         # a catalog table, db.name (exactly one of path and table)
    "format": None,        # path inputs: parquet (default) | orc | json
    "vector": _REQUIRED,   # the vector column
    "where": None,         # Spark SQL filter applied before the join
    "columns": None,       # columns to keep (the vector column is always kept); None = all
    "prefix": "",          # prepended to every column name of this side in the output
}
_JOIN_KEYS: dict[str, Any] = {
    "metric": _REQUIRED,
    "k": 1,
    "mode": "exact",
    "direction": None,
    "join_type": "inner",
    "distance_col": None,
    "backend": "auto",
    "precision": "auto",
    "broadcast_limit_bytes": None,
    "query_block_rows": None,
    "target_block_rows": None,
    "max_distance": None,
    "min_similarity": None,
    "on": None,            # key columns (input names, before prefix): name, [names], [[query, target]]
    # mode approx (the IVF plan): recall@k target, lists, lists probed, seed, and a saved index
    "recall": None,        # approx: 0.95
    "nlist": None,
    "nprobe": None,
    "seed": None,          # approx: 0
    "index": None,         # {path: DIR, rebuild: false}: load the index there, or train and save it
}
_INDEX_KEYS: dict[str, Any] = {"path": _REQUIRED, "rebuild": False}
_OUTPUT_KEYS: dict[str, Any] = {
    "path": None,              # a directory; or:
    "table": None,             # a catalog table, db.name (exactly one of path and table)
    "mode": None,              # path: error-if-exists; table: overwrite_partitions
    "partition_by": [],
    "partition_values": None,  # {column: value}: a constant column added to every output row
    "schema_change": "error",  # table: error | add_columns
    "num_files": None,
    "include_vectors": False,
}
# incremental: refresh the last run's output from its state (nearest_join.incremental)
_INCREMENTAL_KEYS: dict[str, Any] = {
    "query_id": _REQUIRED,   # unique id column of each input (input names, before prefix)
    "target_id": _REQUIRED,
    "margin": None,          # candidates kept per query beyond k (nearest_join.incremental.default_margin)
    "state": None,           # a local directory of the state's own (default: inside the output)
}
# By default the state lives inside the output directory (hidden from Spark's readers by its
# leading underscore), so that the output and its state are published in one step.
STATE_DIR = "_nearest_join_state"
_TOP_KEYS = ("name", "query", "target", "join", "output", "incremental", "spark_profile", "spark")

# Spark settings whose names suggest credentials are never logged or written to the summary.
_SECRET_NAME = re.compile(r"password|secret|token|key", re.IGNORECASE)
REDACTED = "*********(redacted)"


class SpecError(ValueError):
    """A bad job spec or input; ``key`` names the spec key (``join.k``) or the file."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


@dataclass(frozen=True)
class InputSpec:
    """One side of the join: where to read it and which columns to use."""

    side: str                         # "query" or "target", the spec key
    paths: tuple[str, ...]            # absolute for local paths; URIs unchanged; () for a table
    vector: str
    where: str | None
    columns: tuple[str, ...] | None
    prefix: str
    table: str | None = None          # db.name, read from the catalog instead of paths
    format: str = "parquet"           # of the paths: parquet | orc | json

    @property
    def source(self) -> str:
        """What this side reads, for messages: ``table db.name`` or its paths."""
        return f"table {self.table}" if self.table else ", ".join(self.paths)


@dataclass(frozen=True)
class JoinSpec:
    """The ranking and the options of :func:`nearest_join.nearest_by_join`.

    ``options`` is the library's own :class:`nearest_join.options.JoinOptions`, built and
    validated by the library from the ``join`` section (``k`` is its ``num_results``); its
    ``vectors`` are set by the runner from ``query.vector`` and ``target.vector``.
    """

    metric: str
    options: JoinOptions
    index: IndexSpec | None = None    # join.index (mode approx)


@dataclass(frozen=True)
class IndexSpec:
    """``join.index``: where the IVF index lives; ``rebuild`` trains and saves it again
    (otherwise a saved one is reused and only a missing one is trained)."""

    path: str                         # absolute local path of the index directory
    rebuild: bool

@dataclass(frozen=True)
class OutputSpec:
    path: str | None                  # absolute local path; None for a table
    mode: str                         # "overwrite" | "error-if-exists" | "overwrite_partitions"
    partition_by: tuple[str, ...]
    num_files: int | None
    include_vectors: bool
    table: str | None = None          # db.name
    partition_values: tuple[tuple[str, str], ...] = ()   # (column, value): constant columns
    schema_change: str = "error"      # tables: "error" | "add_columns"

    @property
    def target(self) -> str:
        """Where the output goes, for messages: its path, or ``table db.name``."""
        return f"table {self.table}" if self.table else str(self.path)


@dataclass(frozen=True)
class IncrementalSpec:
    """``incremental``: each run refreshes the output from the state the last one kept."""

    query_id: str                     # input column names (before prefix)
    target_id: str
    margin: int | None
    state: str | None = None          # None: OUTPUT/_nearest_join_state

    def state_path(self, output: OutputSpec) -> str:
        return local_path(self.state) if self.state is not None else os.path.join(output.path, STATE_DIR)


@dataclass(frozen=True)
class JobSpec:
    name: str
    source: str                       # the spec file, for messages and the summary
    query: InputSpec
    target: InputSpec
    join: JoinSpec
    output: OutputSpec
    spark_profile: str
    spark_settings: dict[str, str]    # profile + spec + overrides; may hold secrets
    document: dict[str, Any]          # the spec after overrides and parameters (may hold secrets)
    incremental: IncrementalSpec | None = None
    parameters: dict[str, str] | None = None   # the run parameters the spec used (--param)

    @property
    def uses_tables(self) -> bool:
        """Whether an input or the output is a catalog table (the session then needs one)."""
        return any(x is not None for x in (self.query.table, self.target.table, self.output.table))

    def redacted_document(self) -> dict[str, Any]:
        """The spec as written, with secret-looking Spark settings masked."""
        doc = copy.deepcopy(self.document)
        if isinstance(doc.get("spark"), dict):
            doc["spark"] = redact_settings(doc["spark"])
        return doc


def redact_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Mask the values of settings whose names contain password, secret, token or key."""
    return {k: (REDACTED if _SECRET_NAME.search(str(k)) else v) for k, v in settings.items()}


def conf_dir() -> Path:
    """Where the Spark profiles (``local.yaml``...) live.

    ``NEAREST_JOIN_CONF_DIR`` if set, else ``conf/`` of the source checkout this package was
    installed from (``pip install -e .``), else ``./conf``.
    """
    env = os.environ.get("NEAREST_JOIN_CONF_DIR")
    if env:
        return Path(env)
    beside = Path(__file__).resolve().parent.parent / "conf"
    return beside if beside.is_dir() else Path("conf").resolve()


# -- YAML ------------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys instead of keeping the last one."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep=False):
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag == "tag:yaml.org,2002:bool":
            # Keys are names: YAML 1.1 reads a plain `on:` (and yes/no/off) as a boolean.
            key_node.tag = "tag:yaml.org,2002:str"
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:  # `? [a, b]`: PyYAML's own check would come after ours
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, "found unhashable key",
                key_node.start_mark,
            ) from None
        if key in seen:
            raise SpecError(
                str(key),
                f"duplicate key at line {key_node.start_mark.line + 1} "
                f"(first at line {seen[key] + 1}); keep one",
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


def _construct_int(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> int:
    try:
        return yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError:  # Python refuses int() of more than sys.get_int_max_str_digits() digits
        raise yaml.constructor.ConstructorError(
            None, None, f"integer of {len(node.value):,} digits", node.start_mark
        ) from None


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)

# The most a spec (or one --set value) may expand to, counting one per value plus the
# characters of every scalar, with each alias counted as a full copy of what it refers to.
# A spec is a few hundred values; a file of that size without aliases stays far below. An
# alias bomb ("billion laughs": 9 levels of 9 aliases, 9**9 values from 300 bytes) costs the
# loader nothing, because aliases share one object, but anything that walks the value
# (a repr for a message, a deep copy, the JSON summary) would expand it in memory.
MAX_EXPANDED_SIZE = 10_000_000


class _Expansion:
    """Expanded sizes of the nodes of one composed YAML document, linear in its distinct nodes."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.cyclic = False
        self._within: set[int] = set()

    def size(self, node: yaml.Node) -> int:
        key = id(node)
        if key in self.sizes:
            return self.sizes[key]
        if key in self._within:  # an alias to an enclosing node (`a: &x [*x]`): endless
            self.cyclic = True
            return MAX_EXPANDED_SIZE + 1
        if isinstance(node, yaml.ScalarNode):
            size = 1 + len(node.value)
        else:
            self._within.add(key)
            children = (
                [part for pair in node.value for part in pair]
                if isinstance(node, yaml.MappingNode) else node.value
            )
            size = 1 + sum(self.size(child) for child in children)
            self._within.discard(key)
        self.sizes[key] = size
        return size


def _check_expansion(root: yaml.Node, key: str) -> None:
    """Refuse a document that expands past :data:`MAX_EXPANDED_SIZE`, naming the key."""
    expansion = _Expansion()
    if expansion.size(root) <= MAX_EXPANDED_SIZE:
        return
    # Descend through mappings to the innermost key whose value is too large: that is the
    # key to name (`join.k`), not the document or the section around it.
    names, node = [], root
    while isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if expansion.sizes[id(value_node)] > MAX_EXPANDED_SIZE:
                names.append(str(key_node.value) if isinstance(key_node, yaml.ScalarNode)
                             else f"<key at line {key_node.start_mark.line + 1}>")
                node = value_node
                break
        else:
            break
    what = "refers to itself through a YAML alias" if expansion.cyclic else (
        f"expands to more than {MAX_EXPANDED_SIZE:,} values and characters (YAML aliases "
        "repeat what they refer to)")
    raise SpecError(
        _join_key(key, ".".join(names)),
        f"the {node.id} at line {node.start_mark.line + 1} {what}; expected a scalar or a "
        "short list",
    )


def _join_key(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _parse_yaml(text: str, *, key_prefix: str = "", source: str = "") -> Any:
    """Safe-load one YAML document after checking what its aliases expand to.

    Errors name ``key_prefix`` plus the dotted path of the offending value, or ``source``
    when the problem is the whole document.
    """
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, key_prefix)
        return loader.construct_document(node)
    except RecursionError:  # the composer and constructor recurse once per nesting level
        raise SpecError(key_prefix or source, "YAML nested too deeply; expected a flat spec") from None
    except SpecError as exc:
        if exc.key or not source:
            raise
        raise SpecError(source, exc.message) from None
    finally:
        loader.dispose()


def _load_yaml(path: Path, key: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(key, f"file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise SpecError(key, f"cannot read {str(path)!r}: {exc.strerror}") from None
    try:
        return _parse_yaml(text, source=key)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(key, f"{str(path)!r} is not valid YAML{at}: {problem}") from None


# -- --set overrides ---------------------------------------------------------------------------


def _split_key(key: str) -> tuple[str, ...]:
    # Spark setting names contain dots themselves: everything after "spark." is one key.
    if key.startswith("spark."):
        return ("spark", key[len("spark."):])
    parts = tuple(key.split("."))
    if not key or any(not p for p in parts):
        raise SpecError("--set", f"bad key {key!r}: expected dotted names such as join.k")
    return parts


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """Parse ``--set key=value``: a dotted key and a YAML scalar (or flow list) value.

    >>> parse_override("join.k=5")
    (('join', 'k'), 5)
    >>> parse_override("spark.spark.sql.shuffle.partitions=8")
    (('spark', 'spark.sql.shuffle.partitions'), 8)
    >>> parse_override("query.where=id % 2 = 0")
    (('query', 'where'), 'id % 2 = 0')
    """
    if "=" not in text:
        raise SpecError("--set", f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    path = _split_key(key.strip())
    try:
        value = _parse_yaml(raw, key_prefix=".".join(path))
    except yaml.YAMLError:
        value = raw  # not YAML (e.g. starts with '%' or '@'): take the text as it is
    if isinstance(value, dict):
        raise SpecError(key, "--set takes a scalar or a [list]; set one dotted key per value")
    return path, value


def apply_overrides(document: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``document`` with every ``--set key=value`` applied in order."""
    result = copy.deepcopy(document)
    for text in overrides:
        path, value = parse_override(text)
        node = result
        for depth, name in enumerate(path[:-1]):
            child = node.get(name)
            if child is None:
                child = node[name] = {}
            if not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                raise SpecError(".".join(path), f"cannot set it: {where} is not a mapping")
            node = child
        node[path[-1]] = value
    return result


# -- validation --------------------------------------------------------------------------------


def _check_known(section: dict, known, prefix: str) -> None:
    for key in section:
        if key not in known:
            hint = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
            did = f"; did you mean {prefix}{hint[0]}?" if hint else ""
            raise SpecError(
                f"{prefix}{key}", f"unknown key (known: {', '.join(map(str, known))}){did}"
            )


def _mapping(value: Any, key: str) -> dict:
    if not isinstance(value, dict):
        raise SpecError(key, f"expected a mapping, got {describe(value)}")
    return value


def _section(document: dict, name: str, schema: dict[str, Any]) -> dict[str, Any]:
    if name not in document or document[name] is None:
        raise SpecError(name, "missing (required section)")
    section = _mapping(document[name], name)
    _check_known(section, schema, f"{name}.")
    values = {}
    for key, default in schema.items():
        value = section.get(key, None if default is _REQUIRED else default)
        if value is None and default is _REQUIRED:
            raise SpecError(f"{name}.{key}", "missing (required)")
        values[key] = value
    return values


def _text(value: Any, key: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip():
        raise SpecError(key, f"expected a non-empty string, got {describe(value)}")
    return value


def _integer(value: Any, key: str, *, low: int, high: int | None = None,
             optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(key, f"expected an integer, got {describe(value)}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise SpecError(key, f"must be {bound}, got {value}")
    return value


def _names(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise SpecError(key, f"expected a list of column names, got {describe(value)}")
    if len(set(value)) != len(value):
        raise SpecError(key, f"lists a column twice: {short(value)}")
    return tuple(value)


def is_local(path: str) -> bool:
    """True for plain paths and ``file:`` URIs (what the atomic writer can rename)."""
    return urlparse(path).scheme in ("", "file")


def local_path(path: str) -> str:
    """The absolute filesystem path of a plain path or a ``file:`` URI."""
    parsed = urlparse(path)
    raw = parsed.path if parsed.scheme == "file" else path
    return os.path.abspath(os.path.expanduser(raw))


# A catalog table's name: db.name, or name (the session's current database).
_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?")


def _table_name(value: Any, key: str) -> str:
    if not isinstance(value, str) or not _TABLE_NAME.fullmatch(value):
        raise SpecError(key, f"expected a table name db.name (letters, digits and _), got {short(value)}")
    return value


def _path_or_table(values: dict[str, Any], section: str) -> None:
    if values["path"] is None and values["table"] is None:
        raise SpecError(f"{section}.path", f"missing (required): give {section}.path or {section}.table")
    if values["path"] is not None and values["table"] is not None:
        raise SpecError(f"{section}.table", f"give {section}.path or {section}.table, not both")


def _input(values: dict[str, Any], side: str) -> InputSpec:
    _path_or_table(values, side)
    common = dict(side=side, vector=_text(values["vector"], f"{side}.vector"),
                  where=_text(values["where"], f"{side}.where", optional=True),
                  columns=None if values["columns"] is None else _names(values["columns"], f"{side}.columns"),
                  prefix=_prefix(values["prefix"], f"{side}.prefix"))
    if values["table"] is not None:
        if values["format"] is not None:
            raise SpecError(f"{side}.format", "applies to path inputs; a table is read in the format "
                                              "its catalog entry names")
        return InputSpec(paths=(), table=_table_name(values["table"], f"{side}.table"), **common)
    fmt = values["format"] if values["format"] is not None else "parquet"
    if fmt not in INPUT_FORMATS:
        raise SpecError(f"{side}.format", f"expected one of {list(INPUT_FORMATS)}, got {short(fmt)}")
    paths = values["path"]
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, list) or not paths or not all(
        isinstance(p, str) and p.strip() for p in paths
    ):
        raise SpecError(f"{side}.path", f"expected a path or a list of paths, got {describe(paths)}")
    return InputSpec(paths=tuple(local_path(p) if is_local(p) else p for p in paths), format=fmt, **common)


def _prefix(value: Any, key: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise SpecError(key, f"expected a string, got {describe(value)}")
    return value


# JoinOptions arguments whose spec key is not ``join.<argument>``.
_OPTION_KEYS = {"num_results": "join.k", "vectors": "query.vector/target.vector"}


def option_key(argument: str | None) -> str:
    """The spec key of a :func:`nearest_join.nearest_by_join` argument (``num_results`` -> ``join.k``)."""
    if not argument:
        return "join"
    return _OPTION_KEYS.get(argument, f"join.{argument}")


def _join(values: dict[str, Any]) -> JoinSpec:
    from nearest_join.errors import ArgumentError, ArgumentTypeError, NearestByJoinError
    from nearest_kernels import METRICS  # pure numpy; the library's list of metrics

    metric = values["metric"]
    if not isinstance(metric, str) or metric not in METRICS:
        raise SpecError("join.metric", f"unknown metric {short(metric)}; expected one of {sorted(METRICS)}")
    # The library validates its own options; the spec only renames k.
    arguments = {("num_results" if key == "k" else key): value
                 for key, value in values.items() if key not in ("metric", "index")}
    try:
        options = JoinOptions(**arguments)
        options.cap(metric)     # the cap argument that fits the metric
    except (ArgumentError, ArgumentTypeError) as exc:
        raise SpecError(option_key(exc.argument), exc.problem) from None
    except NearestByJoinError as exc:
        raise SpecError(option_key(exc.argument), str(exc)) from None
    return JoinSpec(metric=metric, options=options, index=_index(values["index"], options.mode))


def _index(value: Any, mode: str) -> IndexSpec | None:
    if value is None:
        return None
    section = _mapping(value, "join.index")
    _check_known(section, _INDEX_KEYS, "join.index.")
    if section.get("path") is None:
        raise SpecError("join.index.path", "missing (required)")
    path = _text(section["path"], "join.index.path")
    if not is_local(path):
        raise SpecError("join.index.path", f"expected a local filesystem path, got {path!r}")
    rebuild = section.get("rebuild", False)
    if not isinstance(rebuild, bool):
        raise SpecError("join.index.rebuild", f"expected true or false, got {describe(rebuild)}")
    if mode != "approx":
        raise SpecError("join.index", f"applies to join.mode: approx (the IVF plan), got mode {mode!r}")
    return IndexSpec(path=local_path(path), rebuild=rebuild)


def _partition_values(value: Any) -> tuple[tuple[str, str], ...]:
    """``output.partition_values``: {column: value}, each value a string, a number or a date."""
    if value is None:
        return ()
    pairs = []
    for name, setting in _mapping(value, "output.partition_values").items():
        key = f"output.partition_values.{name}"
        if not isinstance(name, str) or not name:
            raise SpecError(key, "expected a column name")
        if isinstance(setting, (dt.date, int)) and not isinstance(setting, bool):
            setting = setting.isoformat() if isinstance(setting, dt.date) else str(setting)
        if not isinstance(setting, str) or not setting:
            raise SpecError(key, f"expected a string, a number or a date, got {describe(setting)}")
        pairs.append((name, setting))
    return tuple(pairs)


def _output(values: dict[str, Any]) -> OutputSpec:
    _path_or_table(values, "output")
    partition_by = _names(values["partition_by"] or [], "output.partition_by")
    common = dict(partition_by=partition_by,
                  num_files=_integer(values["num_files"], "output.num_files", low=1, optional=True),
                  include_vectors=values["include_vectors"],
                  partition_values=_partition_values(values["partition_values"]))
    if not isinstance(common["include_vectors"], bool):
        raise SpecError("output.include_vectors", f"expected true or false, got {describe(common['include_vectors'])}")
    mode, schema_change = values["mode"], values["schema_change"]
    if mode is not None and mode not in WRITE_MODES:
        raise SpecError("output.mode", f"expected one of {list(WRITE_MODES)}, got {short(mode)}")
    if schema_change not in SCHEMA_CHANGES:
        raise SpecError("output.schema_change", f"expected one of {list(SCHEMA_CHANGES)}, got {short(schema_change)}")
    if values["table"] is not None:
        table = _table_name(values["table"], "output.table")
        if mode not in (None, "overwrite_partitions"):
            raise SpecError("output.mode", f"a table output is written with overwrite_partitions (each run "
                                           f"replaces the partitions it writes), got {mode!r}")
        if not partition_by:
            raise SpecError("output.partition_by", "a table output is partitioned: name its partition columns, "
                                                   "e.g. [run_date] with output.partition_values: "
                                                   "{run_date: ${run_date}}")
        return OutputSpec(path=None, table=table, mode="overwrite_partitions", schema_change=schema_change,
                          **common)
    if mode == "overwrite_partitions" and not partition_by:
        raise SpecError("output.partition_by", "output.mode overwrite_partitions replaces the partitions a run "
                                               "writes: name the partition columns, e.g. [run_date] with "
                                               "output.partition_values: {run_date: ${run_date}}")
    if values["schema_change"] != "error":
        raise SpecError("output.schema_change", "applies to table outputs (output.table)")
    path = _text(values["path"], "output.path")
    if not is_local(path):
        raise SpecError(
            "output.path",
            f"{path!r} is not a local filesystem path; the atomic writer renames directories, "
            "which object stores cannot do atomically (see docs/jobs.md, Atomicity)",
        )
    return OutputSpec(path=local_path(path), mode=mode or "error-if-exists", **common)


def _incremental(document: dict, join: JoinSpec, output: OutputSpec) -> IncrementalSpec | None:
    if document.get("incremental") is None:
        return None
    values = _section(document, "incremental", _INCREMENTAL_KEYS)
    if join.index is not None:
        raise SpecError("join.index", "an incremental job keeps its IVF index in its state (mode approx): "
                                      "expected no join.index")
    if output.table is not None:
        raise SpecError("output.table", "an incremental job refreshes an output directory (output.path); "
                                        "it does not write tables yet")
    if output.mode != "overwrite":
        raise SpecError("output.mode", f"an incremental job replaces its output each run: expected "
                                       f"overwrite, got {output.mode!r}")
    state = _text(values["state"], "incremental.state", optional=True)
    if state is not None and not is_local(state):
        raise SpecError("incremental.state", f"expected a local (or shared POSIX) directory, got {state!r}")
    return IncrementalSpec(query_id=_text(values["query_id"], "incremental.query_id"),
                           target_id=_text(values["target_id"], "incremental.target_id"), state=state,
                           margin=_integer(values["margin"], "incremental.margin", low=0, optional=True))


def _spark_settings(value: Any, key: str) -> dict[str, str]:
    if value is None:
        return {}
    settings = _mapping(value, key)
    result = {}
    for name, setting in settings.items():
        if not isinstance(name, str) or not (name == "master" or name.startswith("spark.")):
            raise SpecError(f"{key}.{name}", "Spark settings are 'master' or names starting with 'spark.'")
        if isinstance(setting, (dict, list)) or setting is None:
            raise SpecError(f"{key}.{name}", f"expected a scalar value, got {describe(setting)}")
        # Spark wants strings; YAML booleans must become Spark's lower-case spelling.
        result[name] = str(setting).lower() if isinstance(setting, bool) else str(setting)
    return result


def load_profile(name: Any) -> tuple[str, dict[str, str]]:
    """(name, Spark settings) of the profile ``name``: one of ``conf/`` (``local``...) or a
    YAML file's path. Raises SpecError (``spark_profile``) for one not found or malformed."""
    name = _text(name, "spark_profile")
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        path = Path(name).expanduser()
    else:
        path = conf_dir() / f"{name}.yaml"
    if not path.is_file():
        raise SpecError(
            "spark_profile",
            f"profile {name!r} not found at {str(path)!r}; use local, cluster-cpu, cluster-gpu, "
            "a path to a YAML file, or set NEAREST_JOIN_CONF_DIR",
        )
    document = _load_yaml(path, "spark_profile")
    return name, _spark_settings(document, f"spark_profile {name}")


# The embedded catalog a spec that uses a table gets when its Spark settings name none: Spark's
# own Hive catalog, its metastore in an embedded Derby database and its tables' files in a
# warehouse directory, both under data/ of the working directory (as relative paths are).
WAREHOUSE_DIR = "data/warehouse"
METASTORE_DIR = "data/metastore_db"


def catalog_settings(settings: dict[str, str]) -> dict[str, str]:
    """``settings`` with the embedded catalog's, unless they configure a catalog themselves.

    A profile or spec that sets ``spark.sql.catalogImplementation`` owns the catalog's
    configuration (a cluster's metastore: ``spark.hadoop.hive.metastore.uris``, or the
    ``hive-site.xml`` that ``spark-submit`` puts on the classpath) and gets nothing added.
    Otherwise: a Hive catalog, an embedded Derby metastore in ``data/metastore_db`` and the
    warehouse in ``data/warehouse``, both under the working directory, created on first use.
    """
    if "spark.sql.catalogImplementation" in settings:
        return dict(settings)
    metastore, warehouse = os.path.abspath(METASTORE_DIR), os.path.abspath(WAREHOUSE_DIR)
    # Derby writes its log to ./derby.log unless told otherwise.
    java = " ".join(filter(None, [settings.get("spark.driver.extraJavaOptions"),
                                  f"-Dderby.stream.error.file={os.path.join(os.path.dirname(metastore), 'derby.log')}"]))
    return {**settings,
            "spark.sql.catalogImplementation": "hive",
            "spark.sql.warehouse.dir": settings.get("spark.sql.warehouse.dir", warehouse),
            "spark.hadoop.javax.jdo.option.ConnectionURL": settings.get(
                "spark.hadoop.javax.jdo.option.ConnectionURL", f"jdbc:derby:;databaseName={metastore};create=true"),
            "spark.driver.extraJavaOptions": java}


def parse_spec(document: Any, source: str = "<spec>", parameters: dict[str, str] | None = None) -> JobSpec:
    """Validate a parsed YAML document and return the :class:`JobSpec` it describes.

    Raises
    ------
    SpecError
        Naming the first bad key; nothing is read or written.
    """
    if not isinstance(document, dict):
        raise SpecError(source, f"a job spec is a YAML mapping, got {describe(document)}")
    _check_known(document, _TOP_KEYS, "")
    query = _input(_section(document, "query", _SIDE_KEYS), "query")
    target = _input(_section(document, "target", _SIDE_KEYS), "target")
    join = _join(_section(document, "join", _JOIN_KEYS))
    output = _output(_section(document, "output", _OUTPUT_KEYS))
    for side in (query, target):
        if output.table is not None and side.table is not None and side.table.lower() == output.table.lower():
            raise SpecError("output.table", f"{output.table!r} is also the {side.side} input; write the "
                                            "output to another table")
    incremental = _incremental(document, join, output)
    profile, settings = load_profile(document.get("spark_profile") or "local")
    settings.update(_spark_settings(document.get("spark"), "spark"))
    if any(x is not None for x in (query.table, target.table, output.table)):
        settings = catalog_settings(settings)
    name = document.get("name") or Path(source).stem
    if not isinstance(name, str):
        raise SpecError("name", f"expected a string, got {describe(name)}")
    return JobSpec(
        name=name, source=source, query=query, target=target, join=join, output=output,
        spark_profile=profile, spark_settings=settings, document=document, incremental=incremental,
        parameters=dict(parameters or {}),
    )


def load_spec(path: str | os.PathLike, overrides: list[str] | None = None,
              params: list[str] | None = None) -> JobSpec:
    """Read the spec file at ``path``, apply ``--set`` overrides, fill in the ``--param``
    run parameters (``${run_date}``: :mod:`jobs.params`), validate.

    Examples
    --------
    >>> spec = load_spec("conf/demo.yaml", ["join.k=3"])  # doctest: +SKIP
    >>> spec.join.options.num_results  # doctest: +SKIP
    3
    """
    source = str(path)
    document = _load_yaml(Path(path), source)
    if document is None:
        raise SpecError(source, "the file is empty")
    if not isinstance(document, dict):
        raise SpecError(source, f"a job spec is a YAML mapping, got {describe(document)}")
    document = apply_overrides(document, list(overrides or []))
    try:
        document, used = substitute(document, parse_params(params))
    except ParameterError as exc:
        raise SpecError(exc.key, exc.message) from None
    return parse_spec(document, source, used)


# -- filesystem checks (before Spark starts) ---------------------------------------------------


def _has_magic(path: str) -> bool:
    return glob.has_magic(path)


def _related(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def _real(path: str | Path) -> Path:
    # os.path.realpath resolves the symlinks of the part of the path that exists and keeps a
    # missing tail as written, so a new output is placed by its nearest existing ancestor.
    return Path(os.path.realpath(path))


def check_paths(spec: JobSpec) -> None:
    """Check what can be checked on the local filesystem before Spark starts.

    Local inputs exist (or their globs match something); the output is neither an input nor
    inside one nor around one, and is not matched by an input glob (the next run would read
    its own output), both as written and with symlinks resolved; an existing output may be
    replaced only in ``overwrite`` mode and only if nearest-join wrote it; the output's
    directory can be created and written. Non-local inputs (``s3a://``, ``hdfs://``) are
    checked by Spark.
    """
    # A table output's location is the catalog's: jobs.tables checks it once Spark runs.
    output = Path(spec.output.path) if spec.output.path is not None else None
    # Where the output really is: through a symlink (`qlink/out` with qlink -> in/q) an
    # output can sit inside an input whose path looks unrelated, and the reverse.
    outputs = (output, _real(output)) if output is not None else ()
    for side in (spec.query, spec.target):
        for pattern in side.paths:
            if not is_local(pattern):
                continue
            matches = [Path(m) for m in glob.glob(pattern)] if _has_magic(pattern) else (
                [Path(pattern)] if os.path.exists(pattern) else []
            )
            if not matches:
                what = "no file or directory matches" if _has_magic(pattern) else "does not exist:"
                raise SpecError(f"{side.side}.path", f"{what} {pattern!r}")
            if output is None:
                continue
            clash = next((m for m in matches
                          if _related(output, m) or _related(outputs[1], _real(m))), None)
            patterns = {pattern, os.path.realpath(pattern)} if _has_magic(pattern) else set()
            matched = any(fnmatch.fnmatch(str(p), glob_pattern) for glob_pattern in patterns
                          for o in outputs for p in (o, *o.parents))
            if clash is not None or matched:
                real = f" (really {str(outputs[1])!r})" if outputs[1] != output else ""
                raise SpecError(
                    "output.path",
                    f"{str(output)!r}{real} overlaps the {side.side} input "
                    f"{str(clash or pattern)!r}; write the output somewhere that is neither an "
                    "input nor inside or around one",
                )
    if output is None:
        return
    if spec.incremental is not None and spec.incremental.state is not None:
        _check_state_path(spec, outputs)
    check_output_target(spec.output)
    check_output_writable(spec.output)


def _check_state_path(spec: JobSpec, outputs: tuple[Path, Path]) -> None:
    """A state of its own lies outside the output (a new output would delete it) and the
    inputs (a run would read what it writes)."""
    state = Path(local_path(spec.incremental.state))
    places = [("output.path", o) for o in outputs] + [
        (f"{side.side}.path", Path(local_path(m))) for side in (spec.query, spec.target) for pattern in side.paths
        if is_local(pattern) for m in (glob.glob(pattern) if _has_magic(pattern) else [pattern])]
    for key, place in places:
        if _related(state, place) or _related(_real(state), _real(place)):
            raise SpecError("incremental.state", f"{str(state)!r} overlaps {key} {str(place)!r}; keep the "
                                                 "state outside the output and the inputs (or leave "
                                                 "incremental.state out: the state then lives inside the output)")


def _writable(directory: Path) -> bool:
    # The effective user is the one that will create files (setuid wrappers, sudo -u).
    effective = os.access in os.supports_effective_ids
    return os.access(directory, os.W_OK | os.X_OK, effective_ids=effective)


def check_output_writable(output: OutputSpec) -> None:
    """Refuse an output whose directory this user cannot create or write; creates nothing.

    Permission bits are checked here, before Spark starts; what they cannot tell (a read-only
    mount as root) is found when the run takes the output's lock, still before any input is
    read (see :class:`jobs.output.StagedOutput`).
    """
    path = Path(output.path)
    existing = path.parent
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        raise SpecError(
            "output.path",
            f"cannot create {str(path)!r}: {str(existing)!r} is not a directory; choose "
            "another output.path",
        )
    if not _writable(existing):
        raise SpecError(
            "output.path",
            f"cannot write {str(path)!r}: {str(existing)!r} is not writable by this user; "
            "choose another output.path or make it writable",
        )
    if output.mode == "overwrite" and path.is_dir() and not _writable(path):
        raise SpecError(
            "output.path",
            f"cannot replace {str(path)!r}: it is not writable by this user, so its old files "
            "could not be deleted; choose another output.path or make it writable",
        )


def check_output_target(output: OutputSpec) -> None:
    """Refuse an existing output unless the mode allows replacing it and we wrote it."""
    path = Path(output.path)
    if not os.path.lexists(path):
        return
    if not path.is_dir() or path.is_symlink():
        raise SpecError(
            "output.path", f"{str(path)!r} exists and is not a directory; choose another path"
        )
    if output.mode == "error-if-exists":
        raise SpecError(
            "output.path",
            f"{str(path)!r} already exists and output.mode is 'error-if-exists'; delete it, "
            "choose another output.path or set output.mode: overwrite",
        )
    if any(path.iterdir()) and not (path / SUMMARY_FILE).is_file():
        raise SpecError(
            "output.path",
            f"{str(path)!r} exists and was not written by nearest-join (no {SUMMARY_FILE}); "
            "refusing to replace it. Delete it yourself or choose another output.path",
        )
