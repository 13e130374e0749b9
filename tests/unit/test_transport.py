"""shared/transport.py's liveness and drain rules (the scheduler loop and its links use them;
the e2e side: tests/e2e/test_engine_faults.py, test_launcher.py drain tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import zmq

from shared.transport import Drain, PeerClock, router_socket


class _Lines:
    """Collects log lines (event, fields) the way structlog is called."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


def test_drain_waits_for_live_work_until_its_grace_period() -> None:
    log = _Lines()
    drain = Drain(timeout_s=5.0, log=log)
    assert not drain.due(0.0, num_live=0)  # not asked: never due
    drain.request()
    assert not drain.due(1.0, num_live=2) and drain.draining
    assert not drain.due(6.0, num_live=2)  # exactly the grace period: still waiting
    assert drain.due(6.1, num_live=2)
    assert [e for e, _ in log.lines] == ["draining"]  # started once
    assert log.lines[0][1] == {"num_live": 2, "grace_s": 5.0}


def test_drain_finishes_as_soon_as_nothing_is_live() -> None:
    drain = Drain(timeout_s=30.0, log=_Lines())
    drain.request()
    assert not drain.due(0.0, num_live=1)
    assert drain.due(0.5, num_live=0)


def test_peer_clock_names_only_peers_silent_past_the_timeout() -> None:
    clock = PeerClock(timeout_s=10.0)
    clock.heard(b"a", 0.0)
    clock.heard(b"b", 5.0)
    assert clock.silent(10.0) == []
    assert clock.silent(12.0) == [b"a"]
    clock.heard(b"a", 12.0)
    assert clock.silent(15.5) == [b"b"]
    clock.forget(b"b")
    assert b"b" not in clock and len(clock) == 1 and clock.peers() == [b"a"]


def test_router_socket_refuses_a_key_folder_without_keys(tmp_path: Path) -> None:
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="cannot read a CURVE key"):
            router_socket(ctx, _Lines(), curve_keys=tmp_path)
    finally:
        ctx.term()  # returns only if the failed socket was closed
