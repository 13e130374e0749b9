"""Test-only code lives in tests/support/ (a tiny random model, plan drivers); the production
packages (what pyproject installs) never import it, nor anything else under tests/, and hold no
test helper modules of their own. bench/ and tests/ may import it. (The kernels' random inputs,
shared by the kernel tests and the GPU check, are bench/kernel_inputs.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("conveyor", "services", "shared", "kernels")  # what pyproject installs
TEST_PACKAGES = ("tests",)
TEST_MODULE_NAMES = ("testing", "tiny_model", "conftest", "fixtures")
NO_HELPERS_IN = PRODUCTION


def imported_test_modules(source: str) -> list[str]:
    """The modules under tests/ that `source` imports (absolute imports)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [n for n in names if n.split(".")[0] in TEST_PACKAGES]
    return found


def _production_files(packages: tuple[str, ...] = PRODUCTION) -> list[Path]:
    files = [p for package in packages for p in (ROOT / package).rglob("*.py")]
    assert len(files) > 50, len(files)
    return files


def test_production_code_never_imports_test_code() -> None:
    offenders = {
        str(path.relative_to(ROOT)): names
        for path in _production_files()
        if (names := imported_test_modules(path.read_text(encoding="utf-8")))
    }
    assert not offenders, offenders


def test_production_packages_hold_no_test_helpers() -> None:
    helpers = [str(p.relative_to(ROOT)) for p in _production_files(NO_HELPERS_IN)
               if p.stem in TEST_MODULE_NAMES]  # fmt: skip
    assert not helpers, f"move these to tests/support/: {helpers}"


def test_the_check_sees_an_import() -> None:
    source = "import os\nfrom tests.support.tiny_model import x\nimport tests.support\n"
    assert imported_test_modules(source) == ["tests.support.tiny_model", "tests.support"]
    assert imported_test_modules("from .tests import x\nimport testsuite\n") == []
