"""The gateway's front door under saturation: /health and refusals never wait for bodies.

A gateway process of its own (per-client cap 2) in front of the session engine, real sockets:
1. two long streams fill the local client's cap;
2. 48 connections of that client each announce a body of ~1 MiB and send only its first
   64 KiB: each gets its 429 at once, without the rest being sent (the count is read from the
   headers; before, the gateway waited for the whole body and parsed it first);
3. 48 connections of another client (its own API key: below its cap) stall half-way through a
   ~1 MiB body, and 8 more send bodies over the limit (413 as soon as the excess is known);
4. meanwhile, while 4 threads keep the gateway parsing ~1 MiB bodies (each a 400: `prompt`
   of the wrong type), `/health` answers 200 within its promise (1 s, docs/RELIABILITY.md §8)
   plus the slow-host margin, every time;
5. once the streams are closed, the first client is admitted again (its count went back).

Rough runtime: ~5 s after the session engine is up (the gateway's start, two short streams).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.test_gateway import _free_port, _wait_http

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CAP = 2
HEALTH_PROMISE_S = 1.0  # docs/RELIABILITY.md §8: /health within 1 s under any load
BODY_LIMIT = 1 << 20  # the gateway's default --max-body-bytes
NUM_STALLED = 48
NUM_OVERSIZED = 8
NUM_PARSERS = 4
STREAM_TOKENS = 400  # long enough to hold the cap for the whole test on a fast host
SETUP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def gateway_port(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = _free_port()
    log = tmp_path_factory.mktemp("front-door") / "gateway.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "services.gateway", "--engine-addr", engine.frontend_address,
            "--http-port", str(port), "--max-requests-per-client", str(CAP)]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}", proc, timeout=SETUP_TIMEOUT_S)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def _connect(port: int, timeout: float) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def _post_head(length: int, auth: str = "") -> bytes:
    extra = f"Authorization: Bearer {auth}\r\n" if auth else ""
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"{extra}Content-Length: {length}\r\n\r\n"
    ).encode()


def _status(conn: socket.socket) -> int:
    """The status of the next response, read whole (head, then Content-Length bytes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"the gateway closed the connection without an answer: {data[:200]!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    at = head.lower().index(b"content-length:")
    left = int(head[at + 15 :].split(b"\r\n", 1)[0]) - len(rest)
    while left > 0:
        chunk = conn.recv(left)
        assert chunk, "the gateway closed the connection mid-answer"
        left -= len(chunk)
    return int(head[9:12])


def _open_stream(port: int) -> socket.socket:
    """A long greedy stream, once its first event arrived (it now holds a slot)."""
    body = orjson.dumps({"prompt": "Once upon a time", "max_tokens": STREAM_TOKENS,
                         "ignore_eos": True, "temperature": 0, "stream": True})  # fmt: skip
    conn = _connect(port, SETUP_TIMEOUT_S)
    conn.sendall(_post_head(len(body)) + body)
    data = b""
    while b"data:" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"stream closed before its first event: {data[:300]!r}"
        data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:300]
    return conn


def _health_s(port: int) -> float:
    started = time.monotonic()
    with _connect(port, HEALTH_PROMISE_S + SLOW_HOST_MARGIN_S) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _status(conn) == 200
    return time.monotonic() - started


def _parse_load(port: int, stop: threading.Event, answered: list[int]) -> None:
    """~1 MiB bodies the gateway reads and parses whole, back to back, until `stop`."""
    body = orjson.dumps({"prompt": 7, "user": "x" * (BODY_LIMIT - 100)})
    with _connect(port, SETUP_TIMEOUT_S) as conn:
        while not stop.is_set():
            conn.sendall(_post_head(len(body), auth="parser") + body)
            answered.append(_status(conn))


def test_health_and_refusals_before_bodies(gateway_port: int) -> None:
    port, bound = gateway_port, HEALTH_PROMISE_S + SLOW_HOST_MARGIN_S
    streams = [_open_stream(port) for _ in range(CAP)]
    held: list[socket.socket] = []
    try:
        for _ in range(NUM_STALLED):  # the capped client: refused from its headers
            conn = _connect(port, bound)
            held.append(conn)
            conn.sendall(_post_head(BODY_LIMIT - 1) + b"x" * (64 << 10))
            assert _status(conn) == 429  # within `bound`, and the body's rest never sent
        for _ in range(NUM_STALLED):  # another client below its cap: stalled mid-body
            conn = _connect(port, bound)
            held.append(conn)
            conn.sendall(_post_head(BODY_LIMIT - 1, auth="other") + b"x" * (512 << 10))
        for _ in range(NUM_OVERSIZED):
            conn = _connect(port, bound)
            held.append(conn)
            conn.sendall(_post_head(BODY_LIMIT + 1, auth="other"))
            assert _status(conn) == 413
        stop, answered = threading.Event(), []
        parsers = [threading.Thread(target=_parse_load, args=(port, stop, answered))
                   for _ in range(NUM_PARSERS)]  # fmt: skip
        for thread in parsers:
            thread.start()
        try:
            took = [_health_s(port) for _ in range(10)]
        finally:
            stop.set()
            for thread in parsers:
                thread.join(timeout=SETUP_TIMEOUT_S)
        assert max(took) <= bound, took
        assert answered and set(answered) == {400}, answered[:10]
    finally:
        for conn in held + streams:
            conn.close()
    deadline = time.monotonic() + SETUP_TIMEOUT_S  # the closed streams give their slots back
    body = orjson.dumps({"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    while True:
        with _connect(port, SETUP_TIMEOUT_S) as conn:
            conn.sendall(_post_head(len(body)) + body)
            status = _status(conn)
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status == 200
