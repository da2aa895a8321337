"""No two kvoffload modules import each other, directly or through others (type-only
imports included): every module of ``src/kvoffload`` can be read bottom-up."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"


def _module(path: pathlib.Path) -> str:
    name = ".".join(path.relative_to(SRC).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted((SRC / "kvoffload").rglob("*.py")):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[_module(path)] = {d for d in deps if d.startswith("kvoffload")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle found by a depth-first walk, as the path that closes it."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph.get(module, ())):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                found.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_the_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_kvoffload() -> None:
    graph = _graph()
    assert "kvoffload.core.scheduler.facade" in graph
    assert cycles(graph) == []
