"""`conveyor up`'s engine flags come from the services' config dataclasses: every field has a
flag, a given flag reaches its service's command line, a bad value fails before any start."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from conveyor.launcher import StackSettings
from conveyor.up import add_up_commands, settings_from_args
from services.scheduler.__main__ import build_parser as scheduler_parser
from services.scheduler.config import SchedulerConfig
from services.scheduler.server_config import ServerConfig
from services.tokenizer.config import FrontendConfig
from services.worker.config import WorkerConfig
from services.worker.sim.config import SimConfig
from shared.config_flags import add_config_flags, config_argv, config_flags, config_from_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_up_commands(parser.add_subparsers(dest="command"))
    return parser


def _parse(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["up", *argv])


def _skipped(name: str) -> tuple[str, ...]:
    return next(f for f in dataclasses.fields(StackSettings) if f.name == name).metadata["skip"]


def test_every_config_field_is_an_up_flag() -> None:
    up = _parser()._subparsers._group_actions[0].choices["up"]  # type: ignore[union-attr]
    flags = {opt for action in up._actions for opt in action.option_strings}
    nested = (("scheduler_config", SchedulerConfig), ("server_config", ServerConfig),
              ("worker_config", WorkerConfig), ("sim_config", SimConfig),
              ("frontend_config", FrontendConfig))  # fmt: skip
    for name, cls in nested:
        skip = _skipped(name) if name != "scheduler_config" else ()
        for flag in config_flags(cls, skip=skip):
            assert flag.option in flags, (cls.__name__, flag.name)
    assert {"--max-num-seqs", "--dtype", "--sim-device", "--router-policy", "--http-port",
            "--summary-interval", "--max-retries", "--drain-timeout"} <= flags  # fmt: skip


def test_given_flags_reach_their_service() -> None:
    args = _parse("--max-num-seqs", "8", "--policy", "priority", "--kv-cache-memory", "1GiB",
                  "--dtype", "float32", "--batch-size", "none",
                  "--summary-interval", "2")  # fmt: skip
    settings = settings_from_args(args)
    assert settings.scheduler_config == SchedulerConfig(max_num_seqs=8, policy="priority")
    assert settings.server_config.summary_interval_s == 2.0
    assert settings.worker_config == WorkerConfig(kv_cache_memory=1 << 30, dtype="float32")
    # what the launcher passes on: the flags of the values that are not the default
    assert config_argv(settings.scheduler_config, {}) == ["--max-num-seqs", "8", "--policy",
                                                          "priority"]  # fmt: skip
    assert config_argv(settings.server_config, {}) == ["--summary-interval", "2.0"]
    assert config_argv(settings.worker_config, {}) == ["--dtype", "float32", "--kv-cache-memory",
                                                       str(1 << 30)]  # fmt: skip
    default = settings_from_args(_parse())
    assert config_argv(default.scheduler_config, {}) == []  # the services' defaults apply
    sim = settings_from_args(_parse("--worker", "sim", "--dtype", "float32", "--sim-device",
                                    "none"))  # fmt: skip
    assert sim.sim() == SimConfig(device="none")  # the simulated worker's own flags


def test_an_invalid_engine_setting_fails_before_start() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        settings_from_args(_parse("--max-num-seqs", "64", "--max-num-batched-tokens", "32"))
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        settings_from_args(_parse("--worker", "sim", "--tensor-parallel-size", "3"))


def test_async_scheduling_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlap scheduling is the scheduler's default (issue 18); `--no-async-scheduling` or
    CONVEYOR_ASYNC_SCHEDULING=0 turn it off, and the scheduler process reads what `up` passes."""
    monkeypatch.delenv("CONVEYOR_ASYNC_SCHEDULING", raising=False)
    assert SchedulerConfig().async_scheduling and SchedulerConfig().max_plans_in_flight == 2
    assert settings_from_args(_parse()).scheduler_config.async_scheduling is True
    off = settings_from_args(_parse("--no-async-scheduling")).scheduler_config
    scheduler = argparse.ArgumentParser()
    add_config_flags(scheduler, SchedulerConfig)
    argv = config_argv(off)
    assert argv == ["--async-scheduling", "false"]
    config = config_from_args(scheduler, scheduler.parse_args(argv), SchedulerConfig)
    assert config.async_scheduling is False and config.max_plans_in_flight == 1
    monkeypatch.setenv("CONVEYOR_ASYNC_SCHEDULING", "0")
    assert settings_from_args(_parse()).scheduler_config.async_scheduling is False
    # with the variable set, the launcher passes even the default: the child reads the flag
    assert config_argv(SchedulerConfig()) == ["--async-scheduling", "true"]


def test_the_scheduler_process_rebuilds_what_up_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """config -> argv -> the scheduler's own parser -> the same configs (one mechanism)."""
    monkeypatch.setenv("CONVEYOR_MAX_NUM_SEQS", "4")  # the child's environment loses to flags
    settings = settings_from_args(_parse("--max-num-seqs", "32", "--max-retries", "5",
                                         "--watermark", "0.1"))  # fmt: skip
    sched, server = settings.scheduler_config, settings.server_config
    assert sched.max_num_seqs == 32 and server.max_retries == 5
    parser = scheduler_parser()
    args = parser.parse_args(config_argv(sched) + config_argv(server))
    assert config_from_args(parser, args, SchedulerConfig) == sched
    assert config_from_args(parser, args, ServerConfig) == server


def test_data_parallel_flags() -> None:
    """--data-parallel-size reaches the stack; --router-policy the frontend; 0 engines fail."""
    settings = settings_from_args(_parse("--data-parallel-size", "3", "--router-policy",
                                         "least-load"))  # fmt: skip
    assert settings.data_parallel_size == 3
    assert settings.frontend_config.router.policy == "least-load"
    assert settings_from_args(_parse()).frontend_config.router.policy == "auto"
    with pytest.raises(ValueError):
        settings_from_args(_parse("--data-parallel-size", "0"))


def test_one_drain_timeout_for_up_and_the_services(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain time-out is defined once (shared.env.DRAIN_TIMEOUT_S): `up`, the scheduler and
    the tokenizer start from it, and CONVEYOR_DRAIN_TIMEOUT moves all three."""
    monkeypatch.delenv("CONVEYOR_DRAIN_TIMEOUT", raising=False)
    up = settings_from_args(_parse()).drain_timeout_s
    assert up == ServerConfig().drain_timeout_s == FrontendConfig().drain_timeout_s
    monkeypatch.setenv("CONVEYOR_DRAIN_TIMEOUT", "7")
    assert settings_from_args(_parse()).drain_timeout_s == 7.0
