"""The project's own Python source, read with `ast`: its modules and every import they make.

For the tests of the house rules (tests/unit/test_import_graph.py, test_code_size.py,
test_process_imports.py). Every import counts: module level, inside functions and under
`if TYPE_CHECKING:`, since each is a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# every package outside tests/ (bench/ is a namespace package of scripts)
SOURCE_PACKAGES = ("conveyor", "services", "shared", "kernels", "bench")


@dataclass(frozen=True, slots=True)
class Module:
    name: str  # dotted, e.g. "services.worker.runner" (a package: its name, no "__init__")
    path: Path
    is_package: bool  # an __init__.py

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(ROOT))


@cache
def modules(packages: tuple[str, ...] = SOURCE_PACKAGES) -> dict[str, Module]:
    """name -> Module for every .py file under `packages`."""
    out: dict[str, Module] = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            out[".".join(parts)] = Module(".".join(parts), path, is_package)
    return out


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imported_names(module: Module) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of everything `module` imports, anywhere in it: `import a.b` gives
    "a.b"; `from a import b` gives "a.b" (a submodule, or a name defined in a: see `resolve`);
    relative imports are made absolute."""
    for node in ast.walk(tree(module.path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node.level, node.module)
            for alias in node.names:
                yield (base if alias.name == "*" else f"{base}.{alias.name}"), node.lineno


def _absolute(module: Module, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    parts = module.name.split(".")
    package = parts if module.is_package else parts[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def resolve(name: str, known: dict[str, Module]) -> str | None:
    """The project module an imported dotted name lands in (the longest known prefix: `from
    a.b import f` depends on a.b, `from a import b` on the submodule a.b), or None when it is
    not the project's (the standard library, torch, ...)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


@cache
def import_graph(packages: tuple[str, ...] = SOURCE_PACKAGES) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: the first line that imports it}."""
    known = modules(packages)
    graph: dict[str, dict[str, int]] = {}
    for name, module in known.items():
        edges: dict[str, int] = {}
        for imported, line in imported_names(module):
            target = resolve(imported, known)
            if target is not None and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def functions(module: Module) -> Iterator[tuple[str, int, int]]:
    """(qualified name, first line, number of lines) of every function and method, nested ones
    too (the `def` line through the last line of its body; decorators not counted)."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}{child.name}"
                assert child.end_lineno is not None
                yield qual, child.lineno, child.end_lineno - child.lineno + 1
                yield from walk(child, qual + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree(module.path), "")


def num_lines(module: Module) -> int:
    return len(module.path.read_text(encoding="utf-8").splitlines())
