"""No import circle in the project's own code (conveyor/, services/, shared/, kernels/, bench/).

Every import counts, wherever it is written: at module level, inside a function (a lazy import
only hides the circle from Python, not from a reader) and under `if TYPE_CHECKING:`. A circle
is reported as its modules in order, each with the line that imports the next, so the edge to
cut is in the message.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from tests.support.source_tree import Module, import_graph, imported_names, modules, resolve


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module, each sorted, the list sorted (iterative:
    no recursion limit on a deep graph)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, {})))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
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
                    found.append(sorted(component))
    return sorted(found)


def a_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One circle through the component's first module, as "module:line -> ..." steps (a
    breadth-first path back to the start, inside the component)."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for nxt in sorted(graph[node]):
            if nxt not in members:
                continue
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                path.reverse()
                path.append(start)
                return [f"{a}:{graph[a][b]} -> {b}" for a, b in pairwise(path)]
            if nxt not in came_from:
                came_from[nxt] = node
                todo.append(nxt)
    raise AssertionError(f"no circle through {start}")


def test_no_import_circle() -> None:
    graph = import_graph()
    assert len(graph) > 100, len(graph)
    circles = [a_cycle(graph, c) for c in strongly_connected(graph)]
    assert not circles, "import circles:\n" + "\n".join("  " + "; ".join(c) for c in circles)


def test_the_finder_sees_every_kind_of_import(tmp_path: Path) -> None:
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}, "e": {"e": 5}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert a_cycle(graph, ["a", "b", "c"]) == ["a:1 -> b", "b:2 -> c", "c:3 -> a"]
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import shared.env\n"
        "from . import sibling\n"
        "from ..up import thing\n"
        "if TYPE_CHECKING:\n"
        "    from services.scheduler.request import Request\n"
        "def f():\n"
        "    import services.worker.runner as r\n"
    )
    names = [n for n, _ in imported_names(Module("pkg.sub.mod", source, is_package=False))]
    assert names == ["typing.TYPE_CHECKING", "shared.env", "pkg.sub.sibling", "pkg.up.thing",
                     "services.scheduler.request.Request", "services.worker.runner"]  # fmt: skip
    known = modules()
    assert resolve("services.scheduler.request.Request", known) == "services.scheduler.request"
    assert resolve("services.worker.sim", known) == "services.worker.sim"  # a package
    assert resolve("torch.nn", known) is None
