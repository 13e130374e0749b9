"""`conveyor up` without keys binds only loopback/ipc: asked to expose the frontend without
--curve-keys or the HTTP gateway without --api-key, it refuses before starting anything (a real
`conveyor up` process: exit 2, the reason on stderr, no service started, no log written)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.launcher import StackSettings
from conveyor.up import exposure_refusal
from services.gateway.config import GatewayConfig
from tests.e2e.stack_tools import ROOT, free_port


def _up(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "conveyor", "up", "--worker", "sim", "--quiet",
            "--log-dir", str(tmp_path / "logs"), "--ready-timeout", "5", *flags]  # fmt: skip
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "flags, reason",
    [(["--no-gateway", "--frontend-addr", "tcp://0.0.0.0:{port}"], "--curve-keys"),
     (["--no-gateway", "--frontend-addr", "tcp://*:{port}"], "--curve-keys"),
     (["--frontend-addr", "tcp://127.0.0.1:{port}", "--http-host", "0.0.0.0",
       "--http-port", "{port}"], "--api-key")],
    ids=["frontend-any-interface", "frontend-star", "gateway-any-interface"],
)  # fmt: skip
def test_up_refuses_an_unauthenticated_exposure(
    tmp_path: Path, flags: list[str], reason: str
) -> None:
    port = str(free_port())
    done = _up(tmp_path, *[f.replace("{port}", port) for f in flags])
    assert done.returncode == 2, done.stderr
    assert "refusing to start" in done.stderr and reason in done.stderr, done.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_loopback_ipc_or_authenticated_exposure_is_allowed(tmp_path: Path) -> None:
    def http(host: str, **more: str) -> GatewayConfig:
        return GatewayConfig(http_host=host, **more)

    allowed = [
        StackSettings(frontend_address="tcp://127.0.0.1:5557"),
        StackSettings(frontend_address="ipc:///tmp/conveyor-fe.sock",
                      gateway_config=http("localhost")),
        StackSettings(frontend_address="tcp://0.0.0.0:5557", curve_keys=tmp_path),
        StackSettings(gateway_config=http("0.0.0.0", api_key="k")),
        StackSettings(gateway_config=http("0.0.0.0"), gateway=False),
    ]  # fmt: skip
    for settings in allowed:
        assert exposure_refusal(settings) is None, settings
    assert exposure_refusal(StackSettings(gateway_config=http("::"))) is not None
    assert exposure_refusal(StackSettings(frontend_address="tcp://10.1.2.3:5557")) is not None
