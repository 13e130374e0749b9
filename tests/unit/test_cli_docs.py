"""docs/cli.md is generated from the parsers (conveyor/cli_docs.py) and must not be stale; every
flag of every service comes from a config dataclass field (shared/config_flags.py)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from conveyor.cli_docs import _services, commands, render
from shared.config_flags import Flag, flag_spec

ROOT = Path(__file__).resolve().parents[2]


def test_docs_cli_md_is_up_to_date() -> None:
    want = render()
    have = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert have == want, "docs/cli.md is stale: python -m conveyor.cli_docs > docs/cli.md"


@pytest.mark.parametrize("name", [name for name, _make in _services()])
def test_every_service_flag_is_generated(name: str) -> None:
    """No hand-written flag in a service: each one is a field's (and documented as such)."""
    parser = dict(_services())[name]()
    written = [a.option_strings for a in parser._actions
               if not isinstance(a, argparse._HelpAction) and flag_spec(a) is None]  # fmt: skip
    assert written == []


def test_every_flag_is_documented_with_its_variable() -> None:
    """Each generated flag of each command is in docs/cli.md with its default and variable;
    internal ones only under "Internal settings"."""
    text = render()
    public, internal = text.split("## Internal settings")
    for _name, _about, parser in commands():
        for action in parser._actions:
            flag = flag_spec(action)
            if flag is None or action.option_strings[0].startswith("--no-"):
                continue
            row = _row_start(flag)
            assert row in (internal if flag.internal else public), row
            for variable in flag.envs:
                assert f"`CONVEYOR_{variable}`" in text


def test_internal_fields_are_hidden_from_help() -> None:
    """`metadata={"internal": True}`: the flag works, --help does not show it."""
    parser = dict(_services())["python -m services.tokenizer"]()
    assert "--send-hwm" not in parser.format_help()
    flag = next(flag_spec(a) for a in parser._actions if "--send-hwm" in a.option_strings)
    assert flag is not None and flag.internal
    assert parser.parse_args(["--send-hwm", "7"]).send_hwm == 7


def _row_start(flag: Flag) -> str:
    names = [flag.option, *flag.aliases]
    if flag.convert.kind == "switch":
        names.append("--no-" + flag.option[2:])
    return "| " + " ".join(f"`{n}`" for n in names) + " |"


def test_defaults_in_the_docs_are_the_dataclass_defaults() -> None:
    from services.scheduler.server_config import ServerConfig

    drain = next(f for f in dataclasses.fields(ServerConfig) if f.name == "drain_timeout_s")
    assert f"| `--drain-timeout` | float | `{drain.default}` |" in render()
