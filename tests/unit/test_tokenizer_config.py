"""The tokenizer service's settings (services/tokenizer/config.py): flags beat CONVEYOR_*
variables, which beat defaults; invalid values are refused with ValueError."""

from __future__ import annotations

import pytest

from services.tokenizer.config import (
    DEFAULT_FRONTEND_ADDR,
    FrontendConfig,
    build_parser,
    config_from_args,
)


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FRONTEND_ADDR", "SCHEDULER_ADDR", "FRONTEND_ID", "MAX_FRAME_BYTES", "MODEL"):
        monkeypatch.delenv(f"CONVEYOR_{name}", raising=False)
    cfg = config_from_args(build_parser().parse_args([]))
    assert cfg.frontend_address == DEFAULT_FRONTEND_ADDR == "tcp://127.0.0.1:5557"
    assert cfg.frontend_id.startswith("fe-") and cfg.model is None
    assert cfg.max_frame_bytes == 1 << 20 and cfg.hard_cap_bytes > cfg.max_frame_bytes
    other = config_from_args(build_parser().parse_args([]))
    assert other.frontend_id != cfg.frontend_id  # two frontends never share rids


def test_flag_beats_environment_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_FRONTEND_ADDR", "tcp://127.0.0.1:7001")
    monkeypatch.setenv("CONVEYOR_SCHEDULER_ADDR", "ipc:///tmp/s.sock")
    monkeypatch.setenv("CONVEYOR_FRONTEND_ID", "fe-env")
    monkeypatch.setenv("CONVEYOR_DRAIN_TIMEOUT", "7")
    args = build_parser().parse_args(["--frontend-addr", "tcp://127.0.0.1:7002"])
    cfg = config_from_args(args)
    assert cfg.frontend_address == "tcp://127.0.0.1:7002"
    assert cfg.scheduler_address == "ipc:///tmp/s.sock"
    assert cfg.frontend_id == "fe-env" and cfg.drain_timeout_s == 7.0


@pytest.mark.parametrize(
    "bad",
    [
        {"max_frame_bytes": 0},
        {"max_frame_bytes": 100, "hard_cap_bytes": 10},
        {"heartbeat_s": 0},
        {"drain_timeout_s": -1},
        {"frontend_id": ""},
        {"scheduler_address": ""},
    ],
)
def test_invalid_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        FrontendConfig(**bad)  # type: ignore[arg-type]
