"""Only the worker imports torch: the scheduler process, the launcher and the CLI stay light
(one thread each, the cores left to the worker). And the layering of the packages: shared/
imports no service and no CLI, no service imports another."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.source_tree import import_graph, imported_names, modules

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module",
    ["services.scheduler.__main__", "services.scheduler.server", "services.worker.loop",
     "shared.transport", "services.worker.__main__", "conveyor.cli", "conveyor.launcher",
     "conveyor.healthcheck"],
)  # fmt: skip
def test_module_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# --- the layering, read from the source (every import counts: tests/support/source_tree.py) ---

HEAVY = ("torch", "triton")  # triton imports torch


def _reachable(starts: list[str], graph: dict[str, dict[str, int]]) -> set[str]:
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    return seen


def test_scheduler_reaches_no_torch_import() -> None:
    """No module the scheduler imports, directly or through others, imports torch, even lazily:
    the scheduler process stays one light thread beside the worker."""
    graph = import_graph()
    reached = _reachable([n for n in graph if n.startswith("services.scheduler")], graph)
    assert "shared.protocol.worker_channel" in reached  # the walk follows imports
    heavy = {
        f"{modules()[name].rel}:{line}": imported
        for name in sorted(reached)
        for imported, line in imported_names(modules()[name])
        if imported.split(".")[0] in HEAVY
    }
    assert not heavy, heavy


def test_shared_imports_no_service_and_no_cli() -> None:
    """shared/ holds what several services or the clients use: it depends on none of them."""
    graph = import_graph()
    upward = {
        name: sorted(t for t in edges if t.split(".")[0] in ("services", "conveyor"))
        for name, edges in graph.items()
        if name.startswith("shared")
    }
    assert {name for name in upward if name.startswith("shared.protocol")}  # it looked
    assert not {name: found for name, found in upward.items() if found}


def _service(name: str) -> str | None:
    """The service package a module belongs to ("worker" for services.worker.sim.*)."""
    parts = name.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 1 else None


def test_no_service_imports_another() -> None:
    """One process, one package: services talk over sockets (shared/protocol), never through
    each other's modules. The simulated worker (services/worker/sim) is part of the worker."""
    graph = import_graph()
    services = {_service(n) for n in graph} - {None}
    assert {"scheduler", "tokenizer", "worker", "gateway"} <= services, services
    crossing = {
        name: sorted(t for t in edges if _service(t) not in (None, _service(name)))
        for name, edges in graph.items()
        if _service(name) is not None
    }
    assert not {name: found for name, found in crossing.items() if found}
    assert _service("services.worker.sim.runner") == _service("services.worker.loop")
