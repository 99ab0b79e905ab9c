"""The import graph stays a layered one: no cycles between modules or between folders, and the
import-linter contracts of pyproject.toml hold (each part imports only the parts below it; the
platform and the admin UI reach the engine only through its client and records; the platform
never imports the admin UI)."""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest
from importlinter import cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("loraplex", cache_dir=None)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def node_edges(graph: grimp.ImportGraph, depth: int | None) -> dict[str, set[str]]:
    """Imports between modules (``depth`` None) or between the nodes ``depth`` dotted names deep
    (a folder and everything in it as one node)."""

    def node(module: str) -> str:
        return module if depth is None else ".".join(module.split(".")[:depth])

    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = node(module), node(imported)
            if a != b:
                edges.setdefault(a, set()).add(b)
    return edges


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("depth", [None, 2, 3, 4])
def test_no_import_cycles(graph: grimp.ImportGraph, depth: int | None) -> None:
    assert cycles(node_edges(graph, depth)) == []


def test_the_contracts_hold() -> None:
    code = cli.lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True)
    assert code == 0, "lint-imports found a broken contract (run it for the report)"


def test_a_broken_contract_is_reported(tmp_path: Path) -> None:
    """The linter really checks: a contract the code breaks fails."""
    config = tmp_path / "contracts.toml"
    config.write_text(
        '[tool.importlinter]\nroot_package = "loraplex"\n\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "the platform without the engine client (broken on purpose)"\n'
        'type = "forbidden"\n'
        'source_modules = ["loraplex.platform"]\n'
        'forbidden_modules = ["loraplex.engine.client"]\n'
    )
    assert cli.lint_imports(config_filename=str(config), no_cache=True) == 1
