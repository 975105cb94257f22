"""The package's import graph, read from its source with `ast` (every import, at module level or
inside a function): no module imports the plugin entry point (`plugin.py` imports the runtime,
never the reverse), and no two modules import each other, directly or around a circle.

Importing a submodule runs its packages' `__init__` first, so `a.b.c` counts as importing `a.b`
and `a` too."""

from __future__ import annotations

import ast
from pathlib import Path

from test.helpers import REPO

PACKAGES = ("sglang_magicdec", "magicdec_kernels")
ENTRY_POINT = "sglang_magicdec.plugin"


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (and their parent packages)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                if name.split(".")[0] in PACKAGES and (target := resolve(name)):
                    while target:
                        if target in modules:
                            imported.add(target)
                        target = target.rpartition(".")[0]
        imported.discard(module)
        graph[module] = imported
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert "sglang_magicdec.radix_events" in graph["sglang_magicdec.drafts.snapkv"]
    assert "sglang_magicdec.drafts" in graph["sglang_magicdec.drafts.snapkv"]  # a parent


def test_nothing_imports_the_plugin_entry_point():
    importers = sorted(m for m, targets in import_graph().items() if ENTRY_POINT in targets)
    assert importers == []


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_a_circle_is_found():
    """The check itself: a two-module and a three-module circle, and a chain that is none."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(circles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_the_runtime_packages_import_no_harness():
    """What a server runs never imports the test or benchmark harness (`benchmark/`, `test/`)."""
    importers = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            if any(name.split(".")[0] in ("benchmark", "test") for name in names):
                importers.append(module)
    assert importers == []
