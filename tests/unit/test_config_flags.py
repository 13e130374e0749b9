"""shared/config_flags.py: one flag per config field; flag > CONVEYOR_<FIELD> > default; and
`config_argv`, its inverse."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

from shared.config_flags import (
    add_config_flags,
    config_argv,
    config_flags,
    config_from_args,
    parse_config,
    parse_size,
)


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


# ---- the metadata conventions (shared/config_flags.py's docstring) -----------------------------


@dataclass(frozen=True, slots=True)
class Inner:
    size: int = 2
    hidden: str = "x"


@dataclass(frozen=True, slots=True)
class Outer:
    wait_s: float = field(default=1.0, metadata={"help": "a time"})
    address: str = field(default="a", metadata={"flag": "addr", "env": ("ADDRS", "ADDR")})
    peers: tuple[str, ...] = ("p",)
    secret_bytes: Optional[int] = field(default=None, metadata={"env": None})
    knob: int = field(default=0, metadata={"internal": True, "help": "for tests"})
    inner: Inner = field(default_factory=Inner, metadata={"prefix": "in_", "skip": ("hidden",)})

    def __post_init__(self) -> None:
        if self.knob > 10 * self.inner.size:
            raise ValueError("knob must be <= 10 x inner.size")

    @classmethod
    def from_flags(cls, **values: Any) -> Outer:
        """From flags a knob above its bound is clamped (as FrontendConfig raises its hard cap
        to the frame limit): the same config whenever the values make a valid one."""
        values["knob"] = min(values.get("knob", 0), 10 * values["inner"].size)
        return cls(**values)


def _outer(argv: list[str], env: Optional[dict[str, str]] = None) -> Outer:
    return parse_config(Outer, argv, env or {})


def test_names_variables_and_nested_fields() -> None:
    got = _outer(["--wait", "2", "--addr", "b", "--secret-bytes", "1KiB", "--in-size", "3"])
    assert got == Outer(2.0, "b", ("p",), 1024, 0, Inner(size=3))
    assert _outer(["--knob", "100", "--in-size", "3"]).knob == 30  # from_flags
    env = {"CONVEYOR_ADDR": "c", "CONVEYOR_ADDRS": "d", "CONVEYOR_SECRET_BYTES": "9",
           "CONVEYOR_IN_SIZE": "4", "CONVEYOR_WAIT": "3"}  # fmt: skip
    got = _outer([], env)
    assert (got.address, got.secret_bytes, got.inner.size, got.wait_s) == ("d", None, 4, 3.0)
    with pytest.raises(ValueError):
        _outer(["--in-hidden", "y"])  # skipped where it nests: no flag
    with pytest.raises(ValueError, match="CONVEYOR_WAIT"):
        _outer([], {"CONVEYOR_WAIT": "soon"})


def test_list_fields_take_commas_and_repeats_and_replace_the_variable() -> None:
    assert _outer(["--peers", "a,b", "--peers", "c"]).peers == ("a", "b", "c")
    assert _outer([], {"CONVEYOR_PEERS": "x, y"}).peers == ("x", "y")
    assert _outer(["--peers", "z"], {"CONVEYOR_PEERS": "x,y"}).peers == ("z",)


def test_internal_fields_work_but_hide_from_help() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Outer)
    assert "--knob" not in parser.format_help() and "--wait" in parser.format_help()
    assert config_from_args(parser, parser.parse_args(["--knob", "7"]), Outer).knob == 7
    assert [f.name for f in config_flags(Outer) if f.internal] == ["knob"]


@pytest.mark.parametrize(
    "config",
    [Outer(), Outer(0.5, "q", ("a", "b"), 3 << 20, 1, Inner(9)), Demo(4, None, "x", 0.2, 1 << 30,
     True, False)],
)  # fmt: skip
def test_config_argv_is_the_inverse_of_the_parser(config: object) -> None:
    env = {"CONVEYOR_WAIT": "9", "CONVEYOR_OVERLAP": "0", "CONVEYOR_MAX_NUM_SEQS": "3"}
    for environment in ({}, env):  # the child's environment never wins over the config
        assert parse_config(type(config), config_argv(config, environment), environment) == config
    assert config_argv(Outer(), {}) == []  # defaults need no flag
    assert config_argv(Outer(), {"CONVEYOR_WAIT": "9"}) == ["--wait", "1.0"]


def test_the_services_configs_survive_the_round_trip() -> None:
    from services.gateway.config import GatewayConfig
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.server_config import ServerConfig
    from services.tokenizer.config import FrontendConfig
    from services.tokenizer.router import RouterConfig
    from services.worker.config import ParallelConfig, WorkerConfig
    from services.worker.sim.config import SimConfig

    configs = [
        SchedulerConfig(max_num_seqs=8, policy="priority", async_scheduling=False),
        ServerConfig(frontend_address="ipc:///s", summary_interval_s=0.0, curve_keys=Path("k")),
        WorkerConfig(dtype="float32", kv_cache_memory=384 << 20, pipeline_steps="off"),
        ParallelConfig(1, 2, "tcp://127.0.0.1:1"),
        SimConfig(device="none", model="smollm2-135m", fail_token=7, profile_path=Path("p")),
        FrontendConfig(scheduler_addresses=("ipc:///a", "ipc:///b"), frontend_id="fe-1",
                       router=RouterConfig(policy="least-load", balance_abs=4)),
        GatewayConfig(http_port=9, api_key="k", served_model_name="m", default_max_tokens=3),
    ]  # fmt: skip
    for config in configs:
        assert parse_config(type(config), config_argv(config, {}), {}) == config, config
