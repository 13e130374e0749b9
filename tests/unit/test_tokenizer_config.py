"""The tokenizer service's settings (services/tokenizer/config.py): flags beat CONVEYOR_*
variables, which beat defaults; invalid values are refused with ValueError."""

from __future__ import annotations

import pytest

from services.tokenizer.config import DEFAULT_FRONTEND_ADDR, FrontendConfig, parse_args


def _config(argv: list[str]) -> FrontendConfig:
    return parse_args(argv)[0]


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ("FRONTEND_ADDR", "SCHEDULER_ADDR", "SCHEDULER_ADDRS", "FRONTEND_ID",
             "MAX_FRAME_BYTES", "MODEL", "ROUTER_POLICY")  # fmt: skip
    for name in names:
        monkeypatch.delenv(f"CONVEYOR_{name}", raising=False)
    cfg = _config([])
    assert cfg.frontend_address == DEFAULT_FRONTEND_ADDR == "tcp://127.0.0.1:5557"
    assert cfg.frontend_id.startswith("fe-") and cfg.model is None
    assert cfg.max_frame_bytes == 1 << 20 and cfg.hard_cap_bytes > cfg.max_frame_bytes
    other = _config([])
    assert other.frontend_id != cfg.frontend_id  # two frontends never share rids
    assert cfg.scheduler_addresses == ("tcp://127.0.0.1:5556",)
    assert cfg.router.policy == "auto"


def test_flag_beats_environment_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_FRONTEND_ADDR", "tcp://127.0.0.1:7001")
    monkeypatch.setenv("CONVEYOR_SCHEDULER_ADDR", "ipc:///tmp/s.sock")
    monkeypatch.setenv("CONVEYOR_FRONTEND_ID", "fe-env")
    monkeypatch.setenv("CONVEYOR_DRAIN_TIMEOUT", "7")
    monkeypatch.delenv("CONVEYOR_SCHEDULER_ADDRS", raising=False)
    cfg = _config(["--frontend-addr", "tcp://127.0.0.1:7002"])
    assert cfg.frontend_address == "tcp://127.0.0.1:7002"
    assert cfg.scheduler_addresses == ("ipc:///tmp/s.sock",)
    assert cfg.frontend_id == "fe-env" and cfg.drain_timeout_s == 7.0


@pytest.mark.parametrize(
    "bad",
    [
        {"max_frame_bytes": 0},
        {"max_frame_bytes": 100, "hard_cap_bytes": 10},
        {"heartbeat_s": 0},
        {"drain_timeout_s": -1},
        {"frontend_id": ""},
        {"scheduler_addresses": ()},
        {"scheduler_addresses": ("ipc:///a", "")},
        {"scheduler_addresses": ("ipc:///a", "ipc:///a")},
    ],
)
def test_invalid_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        FrontendConfig(**bad)  # type: ignore[arg-type]


def test_several_engines_by_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeated --scheduler-addr beats CONVEYOR_SCHEDULER_ADDRS, which beats
    CONVEYOR_SCHEDULER_ADDR; engine i is the i-th address."""
    monkeypatch.setenv("CONVEYOR_SCHEDULER_ADDR", "ipc:///tmp/one.sock")
    monkeypatch.setenv("CONVEYOR_SCHEDULER_ADDRS", "tcp://10.0.0.1:5556, tcp://10.0.0.2:5556")
    monkeypatch.setenv("CONVEYOR_ROUTER_POLICY", "least-load")
    cfg = _config([])
    assert cfg.scheduler_addresses == ("tcp://10.0.0.1:5556", "tcp://10.0.0.2:5556")
    assert cfg.router.policy == "least-load"
    argv = ["--scheduler-addr", "ipc:///a", "--scheduler-addr", "ipc:///b",
            "--router-policy", "cache-aware", "--router-balance-abs", "4"]  # fmt: skip
    cfg = _config(argv)
    assert cfg.scheduler_addresses == ("ipc:///a", "ipc:///b")
    assert cfg.router.policy == "cache-aware" and cfg.router.balance_abs == 4
    monkeypatch.delenv("CONVEYOR_SCHEDULER_ADDRS")
    cfg = _config([])
    assert cfg.scheduler_addresses == ("ipc:///tmp/one.sock",)
    with pytest.raises(SystemExit):
        _config(["--router-policy", "random"])


def test_a_frame_limit_above_the_hard_cap_raises_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_HARD_CAP_BYTES", raising=False)
    monkeypatch.delenv("CONVEYOR_MAX_FRAME_BYTES", raising=False)
    cfg = _config(["--max-frame-bytes", "100MiB"])
    assert cfg.max_frame_bytes == cfg.hard_cap_bytes == 100 << 20
    with pytest.raises(SystemExit):
        _config(["--max-frame-bytes", "0"])
