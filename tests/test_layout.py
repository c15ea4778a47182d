"""The layout keeps the architecture visible: the core (``cascade/``'s own modules, and the
``workers`` and ``policies`` packages beside it) imports nothing from the parts around it, and
nothing under ``cascade/``, ``workers/`` or ``policies/`` imports in a circle — between files or
between packages. A type-only import (under ``if TYPE_CHECKING:``) counts: a circle of types is
still a circle for a reader.

The import graph is read from the source with ``ast`` (function-level imports included), so a
lazy import cannot hide a dependency.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cascade", "workers", "policies")
OUTER = ("cascade.backends", "cascade.cli", "cascade.serve", "cascade.tools", "cascade.train")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``tree`` imports (``from pkg import mod`` counts as mod)."""
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            # the longest known module that the name is or lies inside
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> nx.DiGraph:
    files = {module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        for target in imported(ast.parse(path.read_text(), str(path)), set(files)):
            # importing a submodule runs its package's __init__ first: not an edge of its own
            if target != name and not name.startswith(target + "."):
                graph.add_edge(name, target)
    return graph


def package_of(module: str) -> str:
    """The outer package ``module`` lies in, or "cascade" for the core (workers and policies included)."""
    return next((p for p in OUTER if module == p or module.startswith(p + ".")), "cascade")


def test_the_graph_sees_the_modules():
    graph = import_graph()
    assert {"cascade.api", "cascade.engine", "cascade.build", "cascade.tools.bench"} <= set(graph)
    assert {"workers.hf", "workers.pool", "policies.base", "policies.params"} <= set(graph)
    assert graph.has_edge("cascade.api", "cascade.engine")
    assert graph.has_edge("cascade.backends.ray", "cascade.build")  # a lazy import inside a method


def test_no_import_cycle_between_files():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, f"import cycles: {cycles}"


def test_no_import_cycle_between_packages():
    packages = nx.DiGraph()
    for a, b in import_graph().edges:
        if package_of(a) != package_of(b):
            packages.add_edge(package_of(a), package_of(b))
    cycles = list(nx.simple_cycles(packages))
    assert not cycles, f"package cycles: {cycles}"


def test_core_imports_nothing_around_it():
    graph = import_graph()
    bad = [(a, b) for a, b in graph.edges if package_of(a) == "cascade" and package_of(b) != "cascade"]
    assert not bad, f"the core imports outer packages: {bad}"
