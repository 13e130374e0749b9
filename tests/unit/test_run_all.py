"""`make test`'s time budgets (tests/run_all.py): a hung test fails by name within its group's
budget and the run goes on; a hang pytest-timeout cannot interrupt (here: in a fixture) stops
the group at its wall-clock budget, naming the test it was running. Each case runs a small
pytest process on a throw-away test file (~2 s each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bounds import SLOW_HOST_MARGIN_S
from tests.run_all import GROUPS, Group, lane_threads, run_group, run_lanes, select
from tests.support.progress import in_progress

HUNG_BODY = """
import time

def test_fine():
    pass

def test_hangs_in_its_body():
    time.sleep(3600)

def test_after_it():
    pass
"""

HUNG_FIXTURE = """
import time
import pytest

@pytest.fixture
def stuck():
    time.sleep(3600)

def test_hangs_in_a_fixture(stuck):
    pass
"""


def _group(tmp_path: Path, source: str, test_s: int, group_s: int) -> Group:
    folder = tmp_path / "case"
    folder.mkdir()
    (folder / "test_case.py").write_text(source, encoding="utf-8")
    return Group("case", [str(folder)], test_s=test_s, group_s=group_s)


def test_a_hung_test_fails_by_name_and_the_group_goes_on(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    rc, counts = run_group(_group(tmp_path, HUNG_BODY, test_s=2, group_s=120), tmp_path)
    out = capfd.readouterr().out
    assert rc == 1 and counts == {"passed": 2, "failed": 1, "skipped": 0}
    assert "test_hangs_in_its_body" in out and "Timeout" in out
    assert "over its" not in out  # pytest-timeout caught it, not the group budget


def test_a_hang_outside_the_test_body_stops_the_group_and_names_the_test(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # pytest must reach the fixture first: its start-up on a busy host within the margin
    budget = 2 + int(SLOW_HOST_MARGIN_S)
    rc, counts = run_group(_group(tmp_path, HUNG_FIXTURE, test_s=2, group_s=budget), tmp_path)
    out = capfd.readouterr().out
    assert rc != 0 and counts["failed"] == 1
    assert f"over its {budget}s budget, stopped while running" in out
    assert "test_case.py::test_hangs_in_a_fixture" in out


def test_every_group_has_budgets() -> None:
    assert {g.name for g in GROUPS} == {"unit", "kernels", "e2e-engine", "e2e-stacks"}
    for group in GROUPS:
        assert 0 < group.test_s < group.group_s, group


def test_selecting_groups_by_name() -> None:
    assert [g.name for g in select([])] == [g.name for g in GROUPS]
    assert [g.name for g in select(["e2e"])] == ["e2e-engine", "e2e-stacks"]
    assert [g.name for g in select(["kernels", "e2e-stacks"])] == ["e2e-stacks", "kernels"]


def test_progress_file_reads_empty_when_missing(tmp_path: Path) -> None:
    assert in_progress(tmp_path / "none") == ""


def test_lanes_run_side_by_side_and_print_each_group_whole(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    groups = []
    two = "def test_b():\n    pass\n\ndef test_c():\n    pass\n\ndef test_d():\n    assert 0\n"
    for name, source in (("one", "def test_a():\n    pass\n"), ("two", two)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / f"test_{name}.py").write_text(source, encoding="utf-8")
        groups.append(Group(name, [str(folder)], test_s=2, group_s=120))
    results = run_lanes(groups, tmp_path)
    out = capfd.readouterr().out
    assert sorted(c["passed"] for _, c in results) == [1, 2]
    assert sorted(c["failed"] for _, c in results) == [0, 1]
    for name in ("one", "two"):  # each block whole: from its command line to its closing line
        block = out[out.index(f"=== {name}: pytest") : out.index(f"=== {name}: rc=")]
        other = "two" if name == "one" else "one"
        assert f"=== {other}: pytest" not in block and f"=== {other}: rc=" not in block


def test_each_lane_gets_its_share_of_the_cpus_unless_the_caller_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert lane_threads(2) == {"OMP_NUM_THREADS": str(max(1, cores // 2)),
                               "MKL_NUM_THREADS": str(max(1, cores // 2))}  # fmt: skip
    assert lane_threads(cores + 1)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert lane_threads(2) == {}
