"""The default addresses live in one module (shared/addresses.py): no other production module
spells a default port out, so a change there reaches every service, client and command."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from shared import addresses

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("conveyor", "services", "shared", "kernels")
DEFAULT_PORTS = re.compile(r"\b(?:127\.0\.0\.1|localhost|0\.0\.0\.0):(?:5556|5557|5558|8000)\b")


def _code_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant in code, docstrings left out (prose may say
    where things listen by default)."""
    tree = ast.parse(source)
    docstrings = set()
    for node in [tree, *ast.walk(tree)]:
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            docstrings.add(id(body[0].value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and id(node) not in docstrings
    ]  # fmt: skip


def test_default_ports_are_spelled_out_once() -> None:
    home = ROOT / "shared" / "addresses.py"
    spelled = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for package in PRODUCTION
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != home
        for line, text in _code_strings(path.read_text(encoding="utf-8"))
        if DEFAULT_PORTS.search(text)
    ]
    assert not spelled, "use shared/addresses.py:\n" + "\n".join(spelled)
    assert DEFAULT_PORTS.search(addresses.DEFAULT_FRONTEND_ADDR)
    assert _code_strings('"""doc"""\nX = "tcp://127.0.0.1:5557"\n') == [(2, "tcp://127.0.0.1:5557")]


def test_the_frontend_default_follows_the_environment(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("CONVEYOR_FRONTEND_ADDR", raising=False)
    assert addresses.default_frontend_address() == addresses.DEFAULT_FRONTEND_ADDR
    monkeypatch.setenv("CONVEYOR_FRONTEND_ADDR", "tcp://10.0.0.1:6000")
    assert addresses.default_frontend_address() == "tcp://10.0.0.1:6000"
