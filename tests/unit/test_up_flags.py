"""`conveyor up`'s engine flags come from the services' config dataclasses: every field has a
flag, a given flag reaches its service's command line, a bad value fails before any start."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from conveyor.up import WORKER_SKIP, add_up_commands, settings_from_args
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.config_flags import add_config_flags, config_from_args


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_up_commands(parser.add_subparsers(dest="command"))
    return parser.parse_args(["up", *argv])


def test_every_config_field_is_an_up_flag() -> None:
    parser = argparse.ArgumentParser()
    add_up_commands(parser.add_subparsers(dest="command"))
    up = parser._subparsers._group_actions[0].choices["up"]  # type: ignore[union-attr]
    flags = {opt for action in up._actions for opt in action.option_strings}
    for cls, skip in ((SchedulerConfig, ()), (WorkerConfig, WORKER_SKIP)):
        for f in dataclasses.fields(cls):
            if f.name not in skip:
                assert "--" + f.name.replace("_", "-") in flags, (cls.__name__, f.name)


def test_given_flags_reach_their_service() -> None:
    args = _parse("--max-num-seqs", "8", "--policy", "priority", "--kv-cache-memory", "1GiB",
                  "--dtype", "float32", "--batch-size", "none",
                  "--summary-interval", "2")  # fmt: skip
    settings = settings_from_args(args)
    want = {"max_num_seqs": "8", "policy": "priority", "batch_size": "none",
            "summary_interval": "2.0"}  # fmt: skip
    assert settings.scheduler_flags == want
    assert settings.worker_flags == {"kv_cache_memory": str(1 << 30), "dtype": "float32"}
    assert settings_from_args(_parse()).scheduler_flags == {}  # the services' defaults apply
    sim = settings_from_args(_parse("--worker", "sim", "--dtype", "float32"))
    assert sim.worker_flags == {}  # the simulated worker takes none of the real one's flags


def test_an_invalid_engine_setting_fails_before_start() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        settings_from_args(_parse("--max-num-seqs", "64", "--max-num-batched-tokens", "32"))


def test_async_scheduling_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlap scheduling is the scheduler's default (issue 18); `--no-async-scheduling` or
    CONVEYOR_ASYNC_SCHEDULING=0 turn it off, and the scheduler process reads what `up` passes."""
    monkeypatch.delenv("CONVEYOR_ASYNC_SCHEDULING", raising=False)
    assert SchedulerConfig().async_scheduling and SchedulerConfig().max_plans_in_flight == 2
    assert "async_scheduling" not in settings_from_args(_parse()).scheduler_flags
    off = settings_from_args(_parse("--no-async-scheduling")).scheduler_flags["async_scheduling"]
    scheduler = argparse.ArgumentParser()
    add_config_flags(scheduler, SchedulerConfig)
    argv = ["--async-scheduling", off]
    config = config_from_args(scheduler, scheduler.parse_args(argv), SchedulerConfig)
    assert config.async_scheduling is False and config.max_plans_in_flight == 1
    monkeypatch.setenv("CONVEYOR_ASYNC_SCHEDULING", "0")
    flags = settings_from_args(_parse()).scheduler_flags
    assert flags == {"async_scheduling": "False"}


def test_data_parallel_flags() -> None:
    """--data-parallel-size reaches the stack; --router-policy the frontend; 0 engines fail."""
    settings = settings_from_args(_parse("--data-parallel-size", "3", "--router-policy",
                                         "least-load"))  # fmt: skip
    assert settings.data_parallel_size == 3
    assert settings.tokenizer_flags == {"router_policy": "least-load"}
    assert settings_from_args(_parse()).tokenizer_flags == {}
    with pytest.raises(ValueError):
        settings_from_args(_parse("--data-parallel-size", "0"))
