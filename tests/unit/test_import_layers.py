"""The house's layers, read from the source (`ast`; nothing is imported).

Every .py file of the repository is a module (`specmesh/deploy/k8s.py` -> `specmesh.deploy.k8s`,
`tests/unit/test_state.py` -> `tests.unit.test_state`); every `import` / `from ... import` in it,
at module level or inside a function, is an edge to the repository module it names (the most
specific one: `from specmesh.decoding import state` -> `specmesh.decoding.state`). Third-party and
standard-library imports are not edges. A file outside any package (tests, bench scripts) also
resolves names against its own folder and the folders above it, as pytest's and the scripts'
`sys.path` do (`from engine_helpers import ...`).

The rules:
- the library (`specmesh/`) imports nothing above it: no `servicekit`, service (`*_service`),
  `coordinator`, `gateway`, `client`, `ops`, nor `bench` / `tests`;
- `servicekit` (what the services share) imports nothing above it: no service, `coordinator`,
  `gateway`, `client`, `ops`, `bench`, `tests`;
- no import cycle between modules, and none between the top-level packages.

`SPECMESH_LAYERS_ROOT=/path/to/a/checkout pytest tests/unit/test_import_layers.py` checks another tree
(an older commit in a `git worktree`, say).
"""

from __future__ import annotations

import ast
import functools
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(os.environ.get("SPECMESH_LAYERS_ROOT") or Path(__file__).resolve().parents[2])
SKIPPED_DIRS = {"build", "dist", "node_modules", "__pycache__"}  # and every folder whose name starts with "."
ABOVE_LIBRARY = ("servicekit", "coordinator", "gateway", "client", "ops", "bench", "tests")
ABOVE_SERVICEKIT = ("coordinator", "gateway", "client", "ops", "bench", "tests")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line})"


def python_files(root: Path) -> Iterator[Path]:
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS and not d.endswith(".egg-info"))
        yield from (Path(folder) / name for name in sorted(files) if name.endswith(".py"))


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


class ImportGraph:
    """The repository's modules and the import edges between them."""

    def __init__(self, root: Path):
        self.root = root
        self.paths = {module_name(root, path): path for path in python_files(root)}
        self.edges: list[Edge] = []
        for name, path in self.paths.items():
            self.edges.extend(self._edges_of(name, path))

    def _search_prefixes(self, path: Path) -> list[str]:
        """Where an absolute import of `path` is looked up: the repository root, and for a file outside
        any package its own folder and the folders above it (a script's or a test's `sys.path`)."""
        prefixes = [""]
        folder = path.parent
        while folder != self.root and not (folder / "__init__.py").exists():
            prefixes.append(".".join(folder.relative_to(self.root).parts))
            folder = folder.parent
        return prefixes

    def _resolve(self, dotted: str, prefixes: list[str]) -> str | None:
        """The longest repository module that `import dotted` loads, or None (not ours)."""
        parts = dotted.split(".")
        for prefix in prefixes:
            for end in range(len(parts), 0, -1):
                candidate = ".".join(filter(None, [prefix, *parts[:end]]))
                if candidate in self.paths:
                    return candidate
        return None

    def _edges_of(self, name: str, path: Path) -> Iterator[Edge]:
        tree = ast.parse(path.read_text(), filename=str(path))
        prefixes = self._search_prefixes(path)
        package = name if is_package(path) else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [self._resolve(alias.name, prefixes) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package, `level - 1` packages up
                    base_parts = package.split(".") if package else []
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join([*base_parts, *([node.module] if node.module else [])])
                    search = [""]
                else:
                    base, search = node.module or "", prefixes
                for alias in node.names:  # `from a import b`: the module a.b if there is one, else a
                    targets.append(self._resolve(f"{base}.{alias.name}", search) or self._resolve(base, search))
            elif (isinstance(node, ast.Call) and _is_import_module_call(node.func) and node.args
                  and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                targets = [self._resolve(node.args[0].value, prefixes)]  # importlib.import_module("a.b")
            for target in targets:
                if target is not None and target != name:
                    yield Edge(name, target, getattr(node, "lineno", 0))

    def adjacency(self) -> dict[str, set[str]]:
        graph: dict[str, set[str]] = {name: set() for name in self.paths}
        for edge in self.edges:
            graph[edge.source].add(edge.target)
        return graph


def _is_import_module_call(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))


def top(module: str) -> str:
    return module.split(".")[0]


def is_above(module: str, names: tuple[str, ...]) -> bool:
    return top(module) in names or top(module).endswith("_service")


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node, each sorted; iterative (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str]:
    """start -> ... -> start by the fewest edges (breadth first), as the list of modules on the way."""
    parents: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [start, *reversed(path[:-1]), start] if node != start else [start, start]
            if child not in parents:
                parents[child] = node
                queue.append(child)
    return []


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """One shortest cycle through each module of each strongly connected set (a module already on a
    reported cycle starts no other)."""
    found = []
    for component in strongly_connected(graph):
        covered: set[str] = set()
        for module in component:
            if module not in covered:
                path = shortest_cycle(graph, module)
                covered.update(path)
                found.append(" -> ".join(path))
    return found


def upward_edges(graph: ImportGraph, layer: str, above: tuple[str, ...]) -> list[str]:
    return sorted({str(e) for e in graph.edges if top(e.source) == layer and is_above(e.target, above)})


@functools.cache
def _graph() -> ImportGraph:
    graph = ImportGraph(ROOT)
    assert len(graph.paths) > 100 and "specmesh.decoding.state" in graph.paths, f"no repository at {ROOT}"
    return graph


def test_the_resolver_reads_imports_as_python_does(tmp_path):
    """Absolute, relative, `from package import module`, function-level and helper-folder imports."""
    files = {
        "lib/__init__.py": "",
        "lib/core.py": "import json\nfrom . import util\n",
        "lib/util.py": "def f():\n    from lib.core import x\n",
        "app/__init__.py": "",
        "app/main.py": "import lib.core as c\nfrom lib import util\nimport importlib\nimportlib.import_module('lib.util')\n",
        "tests/unit/test_a.py": "from helpers import h\nimport app.main\n",
        "tests/helpers.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = ImportGraph(tmp_path)
    assert {(e.source, e.target) for e in graph.edges} == {
        ("lib.core", "lib.util"), ("lib.util", "lib.core"), ("app.main", "lib.core"), ("app.main", "lib.util"),
        ("tests.unit.test_a", "tests.helpers"), ("tests.unit.test_a", "app.main")}
    assert cycles(graph.adjacency()) == ["lib.core -> lib.util -> lib.core"]


def test_the_library_imports_nothing_above_it():
    offenders = upward_edges(_graph(), "specmesh", ABOVE_LIBRARY)
    assert not offenders, "specmesh/ (the library) imports a layer above it:\n" + "\n".join(offenders)


def test_servicekit_imports_nothing_above_it():
    offenders = upward_edges(_graph(), "servicekit", ABOVE_SERVICEKIT)
    assert not offenders, "servicekit/ imports a layer above it:\n" + "\n".join(offenders)


def test_no_import_cycle_between_modules():
    found = cycles(_graph().adjacency())
    assert not found, "import cycles (one path per strongly connected set of modules):\n" + "\n".join(found)


def test_no_import_cycle_between_top_level_packages():
    graph = _graph()
    packages: dict[str, set[str]] = {top(name): set() for name in graph.paths}
    witness: dict[tuple[str, str], Edge] = {}
    for edge in graph.edges:
        if top(edge.source) != top(edge.target):
            packages[top(edge.source)].add(top(edge.target))
            witness.setdefault((top(edge.source), top(edge.target)), edge)
    found = []
    for component in strongly_connected(packages):
        path = shortest_cycle(packages, component[0])
        found.append(" -> ".join(path) + "\n  " + "\n  ".join(str(witness[a, b]) for a, b in zip(path, path[1:])))
    assert not found, "top-level packages that import each other:\n" + "\n".join(found)
