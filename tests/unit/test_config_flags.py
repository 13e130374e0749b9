"""shared/config_flags.py: one flag per config field; flag > CONVEYOR_<FIELD> > default."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

import pytest

from shared.config_flags import add_config_flags, config_from_args, parse_size


@dataclass(frozen=True, slots=True)
class Demo:
    max_num_seqs: int = 32
    batch_size: Optional[int] = None
    policy: str = "fcfs"
    watermark: float = 0.01
    kv_cache_memory: Optional[int] = None
    ignore: bool = False
    overlap: bool = field(default=True, metadata={"help": "overlap the steps"})

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")


def _parse(argv: list[str]) -> Demo:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Demo)
    return config_from_args(parser, parser.parse_args(argv), Demo)


def test_defaults_stay_the_dataclass_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MAX_NUM_SEQS", "BATCH_SIZE", "POLICY", "WATERMARK", "KV_CACHE_MEMORY"):
        monkeypatch.delenv(f"CONVEYOR_{name}", raising=False)
    assert _parse([]) == Demo()


def test_flags_parse_each_type() -> None:
    argv = ["--max-num-seqs", "4", "--batch-size", "2", "--policy", "priority"]
    argv += ["--watermark", "0.5", "--kv-cache-memory", "1GiB", "--ignore", "yes"]
    got = _parse(argv)
    assert got == Demo(4, 2, "priority", 0.5, 1 << 30, True, True)
    assert _parse(["--batch-size", "none"]).batch_size is None


def test_environment_then_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_MAX_NUM_SEQS", "8")
    assert _parse([]).max_num_seqs == 8
    assert _parse(["--max-num-seqs", "3"]).max_num_seqs == 3


def test_a_switch_on_by_default_turns_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_OVERLAP", raising=False)
    assert _parse([]).overlap is True
    assert _parse(["--no-overlap"]).overlap is False
    assert _parse(["--overlap", "false"]).overlap is False
    monkeypatch.setenv("CONVEYOR_OVERLAP", "0")
    assert _parse([]).overlap is False
    assert _parse(["--overlap"]).overlap is True  # the flag beats the environment


def test_a_field_help_goes_into_the_flag_help() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Demo)
    text = " ".join(parser.format_help().split())
    assert "--overlap [OVERLAP] overlap the steps (default True)" in text
    assert "--max-num-seqs MAX_NUM_SEQS default 32" in text


def test_invalid_values_exit_like_bad_flags() -> None:
    with pytest.raises(SystemExit):
        _parse(["--max-num-seqs", "0"])  # rejected by the dataclass itself
    with pytest.raises(SystemExit):
        _parse(["--max-num-seqs", "many"])


@pytest.mark.parametrize(
    ("text", "size"),
    [("1234", 1234), ("1KiB", 1024), ("512M", 512 << 20), ("1.5g", 3 << 29), ("2GB", 2 << 30)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size
