"""LinkEvents (shared/transport.py): how the scheduler reads its worker-socket monitor. A
disconnect right after a failed handshake (a refused CURVE key, garbage) is no lost worker;
every other disconnect is. The e2e side: tests/e2e/test_curve.py (refused peers) and
tests/e2e/test_engine_faults.py (a killed worker)."""

from __future__ import annotations

import zmq

from shared.transport import LinkEvents


def test_a_refused_peer_is_not_a_lost_worker_but_a_real_disconnect_is() -> None:
    link = LinkEvents()
    assert not link.counts_as_lost(zmq.EVENT_ACCEPTED)
    assert not link.counts_as_lost(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    assert not link.counts_as_lost(zmq.EVENT_DISCONNECTED)  # the refused peer's
    assert link.counts_as_lost(zmq.EVENT_DISCONNECTED)  # the next one: a worker gone


def test_each_failed_handshake_excuses_one_disconnect() -> None:
    link = LinkEvents()
    for failed in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
        assert not link.counts_as_lost(failed)
    assert [link.counts_as_lost(zmq.EVENT_DISCONNECTED) for _ in range(3)] == [False, False, True]
