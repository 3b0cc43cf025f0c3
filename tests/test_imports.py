"""The shape of the house, checked: imports flow one way, jobs -> nearest_join -> udfs ->
nearest_kernels.

The graph is read from the source with :mod:`ast` (no module is imported): every ``import`` and
``from ... import`` in a file, at module level and inside functions alike (``TYPE_CHECKING``
blocks too), relative ones resolved, and the modules a file imports by name
(``importlib.import_module``). A lazy import inside a function is still an arrow between two
modules; if it points back up the layers, or closes a circle, the layout no longer says which
file can be read first.

The rules (``STYLE.md``, "Floors and instruments"):

- no cycle between modules (function-level imports included);
- no import that climbs the layers: udfs never imports nearest_join or jobs, nearest_join never
  imports jobs, nearest_kernels imports nothing of ours;
- no module imports another module's ``_private`` name (``from m import _x`` or ``m._x``), nor a
  private module (``pkg._impl``) from outside its package; a name shared across modules is
  public and says so;
- nearest_kernels imports neither pyspark nor pandas.

The functions are checked on made-up import sets at the end, so that each rule can fail.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lower number, lower floor: a module may import its own floor or the floors below it.
LAYERS = {"jobs": 3, "nearest_join": 2, "udfs": 1, "nearest_kernels": 0}

# What the kernels must never learn about (they run where neither is installed).
KERNELS_FORBIDDEN = ("pyspark", "pandas")


@dataclass(frozen=True)
class Import:
    """One arrow: ``source`` imports ``target`` (a module of ours or a third-party name)."""

    source: str
    target: str
    line: int
    name: str | None = None  # the name taken from ``target`` (``from target import name``)

    def where(self) -> str:
        what = f"{self.target}.{self.name}" if self.name else self.target
        return f"{self.source} (line {self.line}) imports {what}"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path = ROOT, packages=tuple(LAYERS)) -> dict[str, Path]:
    """Every module of our packages, by dotted name."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            modules[module_name(path, root)] = path
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    # ``from . import x`` in a package's __init__ is relative to the package itself; in a plain
    # module, to the package that holds it.
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, source: str, modules: set[str], is_package: bool = False) -> list[Import]:
    """Every import in ``source`` (the text of ``module``), at any depth of the syntax tree.

    ``from pkg import x`` where ``pkg.x`` is one of ``modules`` is an arrow to that submodule;
    otherwise ``x`` is a name taken from ``pkg``. ``import m as alias`` followed by
    ``alias._x`` counts as taking the private name ``_x`` from ``m``. A module that imports by
    name (``importlib.import_module``: a package's lazy names, a registry of backends) draws
    an arrow to every module of ours that one of its strings names; elsewhere such a string is
    a cache folder or a logger's name, not an import.
    """
    tree = ast.parse(source)
    found: list[Import] = []
    aliases: dict[str, str] = {}  # local name -> one of our modules, for ``alias._x``
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, alias.name, node.lineno))
                # ``import a.b`` binds ``a``; ``import a.b as m`` binds ``m`` to ``a.b``.
                bound, named = (alias.asname, alias.name) if alias.asname else (alias.name.split(".")[0],) * 2
                if named in modules:
                    aliases[bound] = named
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = _resolve_relative(module, is_package, node.level, node.module)
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in modules:
                    found.append(Import(module, submodule, node.lineno))
                    aliases[alias.asname or alias.name] = submodule
                else:
                    found.append(Import(module, target, node.lineno, alias.name))
    imports_by_name = False
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and is_private(node.attr)
        ):
            found.append(Import(module, aliases[node.value.id], node.lineno, node.attr))
        if isinstance(node, (ast.Attribute, ast.Name)) and "import_module" in (
                getattr(node, "attr", None), getattr(node, "id", None)):
            imports_by_name = True
    if imports_by_name:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in modules and node.value != module:
                found.append(Import(module, node.value, node.lineno))
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def owner(target: str, modules: set[str]) -> str | None:
    """The module of ours that ``target`` names (``a.b.c`` -> ``a.b`` if only that exists)."""
    parts = target.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(modules: dict[str, Path]) -> list[Import]:
    names = set(modules)
    arrows = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        arrows += imports_of(module, path.read_text(), names, is_package)
    return arrows


def internal_edges(arrows: list[Import], modules: set[str]) -> dict[str, dict[str, Import]]:
    """Module -> {imported module of ours -> the first import that draws that arrow}."""
    edges: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for arrow in arrows:
        target = owner(arrow.target, modules)
        if target is not None and target != arrow.source:
            edges[arrow.source].setdefault(target, arrow)
    return edges


def find_cycles(edges: dict[str, dict[str, object]]) -> list[list[str]]:
    """The circles of ``edges``: its strongly connected components of more than one module.

    Each is a sorted list of modules, every one reachable from every other (Tarjan's algorithm,
    iterative so that a long chain of modules cannot hit the recursion limit). Listing the whole
    component, rather than one closed path through it, names every module that is caught.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    for root in sorted(edges):
        if root in index:
            continue
        visit(root)
        work = [(root, iter(sorted(edges.get(root, ()))))]
        while work:
            current, children = work[-1]
            for child in children:
                if child not in index:
                    visit(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[current] = min(low[current], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[current])
                if low[current] == index[current]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == current:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def layer_of(module: str) -> int:
    return LAYERS[module.split(".")[0]]


def layer_violations(arrows: list[Import], modules: set[str]) -> list[str]:
    """Imports of a module of a higher floor, and nearest_kernels' imports of pyspark or pandas."""
    found = []
    for arrow in arrows:
        target = owner(arrow.target, modules)
        if target is None:
            top = arrow.target.split(".")[0]
            if layer_of(arrow.source) == LAYERS["nearest_kernels"] and top in KERNELS_FORBIDDEN:
                found.append(f"{arrow.where()}: nearest_kernels imports neither pyspark nor pandas")
            continue
        if arrow.source.split(".")[0] == target.split(".")[0]:
            continue
        if layer_of(target) >= layer_of(arrow.source):
            found.append(
                f"{arrow.where()}: {target.split('.')[0]} is not below "
                f"{arrow.source.split('.')[0]} (jobs -> nearest_join -> udfs -> nearest_kernels)"
            )
    return found


def private_violations(arrows: list[Import], modules: set[str]) -> list[str]:
    """Private names taken from another module, and private modules (``pkg._impl``) imported
    from outside the package that holds them."""
    found = []
    for arrow in arrows:
        target = owner(arrow.target, modules)
        if target is None or target == arrow.source:
            continue
        if arrow.name is not None and is_private(arrow.name):
            found.append(f"{arrow.where()}: a private name of another module")
        parts = target.split(".")
        for depth, part in enumerate(parts):
            package = ".".join(parts[:depth])
            if is_private(part) and not (arrow.source == package or arrow.source.startswith(package + ".")):
                found.append(f"{arrow.where()}: {target} is private to {package}")
                break
    return found


def cycle_messages(edges: dict[str, dict[str, Import]]) -> list[str]:
    """One message per circle: its modules, then every arrow between two of them."""
    messages = []
    for members in find_cycles(edges):
        inside = set(members)
        arrows = [
            edges[source][target].where()
            for source in members
            for target in sorted(edges[source])
            if target in inside
        ]
        messages.append("{" + ", ".join(members) + "}\n      " + "\n      ".join(arrows))
    return messages


# -- the checks on the real tree ---------------------------------------------------------------

@pytest.fixture(scope="module")
def graph():
    modules = package_modules()
    return set(modules), import_graph(modules)


def test_every_package_is_found(graph):
    modules, _ = graph
    for package in LAYERS:
        assert package in modules, f"no package {package!r} under {ROOT}"
    assert len(modules) > 40


def test_no_import_cycle(graph):
    modules, arrows = graph
    cycles = cycle_messages(internal_edges(arrows, modules))
    assert not cycles, "import cycles (function-level imports included):\n  " + "\n  ".join(cycles)


def test_no_import_cycle_among_the_benchmarks():
    """The benchmarks are scripts beside the library, not a floor of it, but a circle among
    their shared modules (the recorder, the report) as much leaves no file to read first."""
    modules = package_modules(packages=("benchmarks",))
    assert "benchmarks._record" in modules and "benchmarks.report" in modules
    cycles = cycle_messages(internal_edges(import_graph(modules), set(modules)))
    assert not cycles, "import cycles among the benchmarks:\n  " + "\n  ".join(cycles)


def test_imports_go_down_the_layers(graph):
    modules, arrows = graph
    wrong = layer_violations(arrows, modules)
    assert not wrong, "imports that climb the layers:\n  " + "\n  ".join(wrong)


def test_no_private_name_crosses_a_module(graph):
    modules, arrows = graph
    wrong = private_violations(arrows, modules)
    assert not wrong, "private names imported from another module:\n  " + "\n  ".join(wrong)


# -- the checks can fail: the same functions on made-up import sets -----------------------------

def _made_up(sources: dict[str, str]) -> tuple[set[str], list[Import]]:
    modules = set(sources)
    arrows = []
    for module, text in sources.items():
        arrows += imports_of(module, text, modules, is_package="." not in module)
    return modules, arrows


def test_a_lazy_import_cycle_is_found():
    modules, arrows = _made_up({
        "udfs": "",
        "udfs.a": "from udfs import b\n",
        "udfs.b": "def f():\n    from . import c\n",
        "udfs.c": "import udfs.a\n",
        "udfs.d": "from .a import thing\n",  # points into the cycle, is not part of it
    })
    assert find_cycles(internal_edges(arrows, modules)) == [["udfs.a", "udfs.b", "udfs.c"]]
    message = cycle_messages(internal_edges(arrows, modules))[0]
    assert "udfs.b (line 2) imports udfs.c" in message


def test_an_import_by_name_is_an_arrow():
    modules, arrows = _made_up({
        "udfs": "",
        "udfs.registry": ("import importlib\n"
                          "BACKENDS = {'cpu': 'udfs.cpu'}\n"
                          "def load(name):\n    return importlib.import_module(BACKENDS[name])\n"),
        "udfs.cpu": "from udfs.registry import BACKENDS\n",
        "udfs.cache": "FOLDER = 'udfs.cpu'\n",  # a string, not an import: no import_module here
    })
    edges = internal_edges(arrows, modules)
    assert "udfs.cpu" in edges["udfs.registry"] and edges["udfs.cache"] == {}
    assert find_cycles(edges) == [["udfs.cpu", "udfs.registry"]]


def test_two_separate_cycles_are_both_named():
    edges = {"a": {"b": 1}, "b": {"a": 1}, "c": {"d": 1}, "d": {"e": 1}, "e": {"c": 1}, "f": {"a": 1}}
    assert find_cycles(edges) == [["a", "b"], ["c", "d", "e"]]
    assert find_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []


def test_an_upward_import_is_named():
    modules, arrows = _made_up({
        "nearest_join": "",
        "nearest_join.plan": "from udfs.search import grouped_search\n",  # down: fine
        "udfs": "",
        "udfs.search": "def f():\n    from nearest_join.plan import x\n",
        "nearest_kernels": "",
        "nearest_kernels.cpu": "import udfs.search\nimport pandas as pd\nimport numpy\n",
        "jobs": "",
    })
    wrong = layer_violations(arrows, modules)
    assert len(wrong) == 3, wrong
    assert any("nearest_kernels.cpu (line 1) imports udfs.search" in m for m in wrong)
    assert any("udfs.search (line 2) imports nearest_join.plan.x" in m for m in wrong)
    assert any("nearest_kernels.cpu (line 2) imports pandas" in m for m in wrong)


def test_a_private_name_from_another_module_is_named():
    modules, arrows = _made_up({
        "udfs": "",
        "udfs.a": "_own = 1\n",
        "udfs.b": "from .a import _own, __doc__\n",
        "udfs.c": "from udfs import a as m\nm._own\n",
        "udfs._d": "",
        "udfs.e": "from . import _d\n",  # a private module of the same package: allowed
        "nearest_kernels": "",
        "nearest_kernels._impl": "def helper(): ...\n",
        "nearest_kernels.gpu": "from ._impl import helper\n",  # the package's own public face: allowed
        "udfs.f": "def f():\n    from nearest_kernels._impl import helper\n",
    })
    wrong = private_violations(arrows, modules)
    assert wrong == [
        "udfs.b (line 1) imports udfs.a._own: a private name of another module",
        "udfs.c (line 2) imports udfs.a._own: a private name of another module",
        "udfs.f (line 2) imports nearest_kernels._impl.helper: "
        "nearest_kernels._impl is private to nearest_kernels",
    ]


def test_relative_imports_resolve():
    assert _resolve_relative("udfs.payload", False, 1, "merge") == "udfs.merge"
    assert _resolve_relative("udfs", True, 1, "merge") == "udfs.merge"
    assert _resolve_relative("nearest_join.kernels.cpu", False, 2, "errors") == "nearest_join.errors"
    assert _resolve_relative("nearest_join.kernels", True, 1, None) == "nearest_join.kernels"


def test_the_gpu_machine_s_test_run_loads_without_pyspark():
    """The device runs the kernel tests (``tests/kernels/gpu_test_run.py``) where pyspark is not
    installed: the suite's conftest and the kernel test modules must load without it."""
    import subprocess
    import sys

    script = ("import sys; sys.modules['pyspark'] = None\n"
              "import tests.conftest, tests.kernels.test_gpu_exactness, tests.kernels.test_gpu\n"
              "assert sys.modules['pyspark'] is None")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
