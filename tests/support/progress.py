"""A pytest plugin for tests/run_all.py: the test running now, written to a file.

`make test` gives each group a wall-clock budget; when a group outruns it (a test hung where
pytest-timeout cannot interrupt it: inside a fixture, or in C code that never returns to
Python), run_all stops the group and names the test this file holds. Loaded with
`-p tests.support.progress`; the file is $CONVEYOR_TEST_PROGRESS (nothing is written without
it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ENV = "CONVEYOR_TEST_PROGRESS"


def _write(text: str) -> None:
    path = os.environ.get(ENV)
    if path:
        Path(path).write_text(text, encoding="utf-8")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Around each test, its set-up and tear-down included: its node id, then nothing."""
    _write(item.nodeid)
    try:
        return (yield)
    finally:
        _write("")


def in_progress(path: Path) -> str:
    """The node id the plugin wrote last ("" between tests or when nothing ran)."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return ""
