"""The house's size rules, outside tests/: no function over 60 lines, no module over 400.

A function is measured from its `def` line to the last line of its body (docstring and
comments included, decorators not); a nested function counts inside its parent too. A module
is measured in lines of its file. A long function becomes helpers; a long module becomes a
package of modules, one concern each.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.source_tree import Module, functions, modules, num_lines

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def test_no_function_over_60_lines() -> None:
    found = modules()
    assert len(found) > 100, len(found)
    long = [
        f"{m.rel}:{line} {name} ({n} lines)"
        for m in found.values()
        for name, line, n in functions(m)
        if n > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(long)


def test_no_module_over_400_lines() -> None:
    long = [
        f"{m.rel} ({n} lines)" for m in modules().values() if (n := num_lines(m)) > MAX_MODULE_LINES
    ]
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n  " + "\n  ".join(long)


def test_the_measures(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    body = "\n".join(f"    x = {i}" for i in range(59))
    source.write_text(
        "@decorator\n"
        f"def exactly_60():\n{body}\n"
        "class C:\n"
        "    def method(self):\n"
        "        def inner():\n"
        "            return 1\n"
        "        return inner\n"
    )
    module = Module("m", source, is_package=False)
    assert list(functions(module)) == [
        ("exactly_60", 2, 60),
        ("C.method", 63, 4),
        ("C.method.inner", 64, 2),
    ]
    assert num_lines(module) == 66
