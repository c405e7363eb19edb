"""The import graph of a package's modules, read from their source, and the cycles in it.

Pure: modules are parsed with ``ast``, never imported. Every import statement counts, wherever
it stands: at module level, inside a function (a deferred import that hides a cycle is still
a cycle) or under ``if TYPE_CHECKING:``. ``from pkg import name`` is an edge to ``pkg.name``
when that is a module of the package, else to ``pkg``; ``import a.b`` is an edge to ``a.b``
(not to its parent packages, whose ``__init__`` importing their children is not a cycle).
Only edges between modules of the package are kept.

In a test: ``assert_no_import_cycles("tessera.zero")``.
"""

from __future__ import annotations

import ast
import importlib.util
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["assert_no_import_cycles", "find_cycles", "import_graph", "import_sites"]

Sites = dict[str, dict[str, int]]
"""module -> {imported module of the same package: line of the first such import}."""


def _modules(package_dir: Path, package_name: str) -> dict[str, tuple[Path, bool]]:
    """Every module under ``package_dir``: dotted name -> (file, whether it is a package)."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join([package_name, *parts])] = (path, is_package)
    return found


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterable[tuple[str, str]]:
    """(the module an import statement binds if it exists, else this one), per imported name."""
    if isinstance(node, ast.Import):
        return [(alias.name, alias.name) for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the package holding ``module``, up level - 1 packages
        anchor = module.split(".")[: None if is_package else -1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return [(f"{base}.{alias.name}", base) for alias in node.names]


def import_sites(package_dir: str | Path, package_name: str) -> Sites:
    """For each module of the package, the modules of the package it imports, with the line."""
    modules = _modules(Path(package_dir), package_name)
    sites: Sites = {}
    for name, (path, is_package) in modules.items():
        edges = sites.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for submodule, fallback in _targets(node, name, is_package):
                target = submodule if submodule in modules else fallback
                if target in modules and target != name:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
    return sites


def import_graph(package_dir: str | Path, package_name: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (see the module docstring)."""
    return {module: set(edges) for module, edges in import_sites(package_dir, package_name).items()}


def _components(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _shortest_cycle(graph: Mapping[str, Iterable[str]], start: str, within: set[str]) -> list[str]:
    """A shortest path start -> ... -> start inside ``within`` (breadth first), without the repeat."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1]
            if w in within and w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is on no cycle")  # unreachable for a strongly connected set


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One shortest cycle per group of mutually importing modules, from its first module by name.

    ``[a, b, c]`` means a imports b, b imports c, c imports a. Empty when the graph is acyclic.
    """
    cycles = []
    for component in _components(graph):
        if len(component) > 1 or component[0] in graph.get(component[0], ()):
            cycles.append(_shortest_cycle(graph, component[0], set(component)))
    return cycles


def assert_no_import_cycles(package: str) -> None:
    """Raise AssertionError naming every import cycle (and its lines) between ``package``'s modules.

    The package is found, not imported (an import cycle may make importing it fail).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssertionError(f"{package!r} is not an importable package")
    problems = []
    for location in spec.submodule_search_locations:
        sites = import_sites(location, package)
        for cycle in find_cycles({m: set(edges) for m, edges in sites.items()}):
            hops = zip(cycle, [*cycle[1:], cycle[0]], strict=True)
            problems.append(" -> ".join(f"{a} (line {sites[a][b]})" for a, b in hops) + f" -> {cycle[0]}")
    assert not problems, f"import cycles in {package}:\n" + "\n".join(problems)
