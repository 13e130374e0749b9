"""The load client and the /health probe of bench/gateway_load.py, each its own process.

The client is made cheap, so that it takes as little as possible of the cores it shares with
the gateway: one asyncio process, raw streams (no HTTP library), one pre-encoded request, a
response read as its status line, its Content-Length and that many bytes (only a 200's body
is decoded, to check its token count). It pins itself to `--cpu` when the OS allows it and
reports its own CPU time.

The probe is a blocking socket in a process of its own, so that its timings are not delayed by
the client's event loop: `GET /health` on one kept-alive connection every `--probe-every` s.

    python bench/gateway_load_client.py load --port P --connections 1000 --duration 60
    python bench/gateway_load_client.py probe --port P --duration 60
Each prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from typing import Any, Optional

import orjson

HEADER_END = b"\r\n\r\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("load", "probe"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--backoff", type=float, default=0.2, help="seconds a refused user waits")
    p.add_argument("--probe-every", type=float, default=0.1)
    p.add_argument("--cpu", type=int, default=None, help="pin the process to this CPU")
    return p.parse_args(argv)


def completion_request(host: str, n: int, max_tokens: int) -> bytes:
    body = orjson.dumps({"prompt": f"user {n} asks", "max_tokens": max_tokens, "temperature": 0})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def content_length(head: bytes) -> int:
    at = head.lower().find(b"content-length:")
    if at < 0:
        return 0
    end = head.find(b"\r\n", at)
    return int(head[at + 15 : end if end >= 0 else len(head)].strip())


class Tally:
    def __init__(self) -> None:
        self.admitted = 0
        self.completed = 0
        self.failed: list[str] = []
        self.refused: dict[int, int] = {}
        self.refusal_s: list[float] = []


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(HEADER_END)
    status = int(head[9:12])
    return status, await reader.readexactly(content_length(head))


async def user(n: int, end: float, args: argparse.Namespace, tally: Tally) -> None:
    """One connection: completions back to back until `end` (reconnects after an error)."""
    request = completion_request(args.host, n, args.max_tokens)
    writer: Optional[asyncio.StreamWriter] = None
    while time.monotonic() < end:
        started = time.monotonic()
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(args.host, args.port)
            writer.write(request)
            status, body = await read_response(reader)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            tally.failed.append(type(exc).__name__)
            writer = None
            await asyncio.sleep(args.backoff)
            continue
        if status in (429, 503):
            tally.refused[status] = tally.refused.get(status, 0) + 1
            tally.refusal_s.append(time.monotonic() - started)
            await asyncio.sleep(args.backoff)  # a client backs off a little before trying again
            continue
        tally.admitted += 1
        usage = orjson.loads(body).get("usage", {}) if status == 200 else {}
        if usage.get("completion_tokens") == args.max_tokens:
            tally.completed += 1
        else:
            tally.failed.append(f"http_{status}: {body[:200]!r}")
    if writer is not None:
        writer.close()


async def load(args: argparse.Namespace) -> dict[str, Any]:
    tally = Tally()
    end = time.monotonic() + args.duration
    await asyncio.gather(*(user(n, end, args, tally) for n in range(args.connections)))
    return {
        "admitted": tally.admitted, "completed": tally.completed,
        "failed": len(tally.failed), "failures": tally.failed[:20],
        "refused": tally.refused, "refusal_s": tally.refusal_s,
    }  # fmt: skip


def probe(args: argparse.Namespace) -> dict[str, Any]:
    """`GET /health` every `probe_every` s on one kept-alive connection (a new one after an
    error); each answer's status and latency."""
    request = f"GET /health HTTP/1.1\r\nHost: {args.host}\r\n\r\n".encode()
    end = time.monotonic() + args.duration
    health_s: list[float] = []
    bad: list[str] = []
    conn: Optional[socket.socket] = None
    while time.monotonic() < end:
        started = time.monotonic()
        try:
            if conn is None:
                conn = socket.create_connection((args.host, args.port), timeout=30.0)
            conn.sendall(request)
            status = _read_status(conn)
        except OSError as exc:
            status, conn = 0, None
            bad.append(type(exc).__name__)
        took = time.monotonic() - started
        health_s.append(took)
        if status != 200:
            bad.append(f"{status} in {took:.3f} s")
        time.sleep(args.probe_every)
    return {"health_s": health_s, "health_bad": bad}


def _read_status(conn: socket.socket) -> int:
    data = b""
    while HEADER_END not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionResetError("closed")
        data += chunk
    head, _, rest = data.partition(HEADER_END)
    left = content_length(head) - len(rest)
    while left > 0:
        chunk = conn.recv(left)
        if not chunk:
            raise ConnectionResetError("closed")
        left -= len(chunk)
    return int(head[9:12])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    pinned: Optional[list[int]] = None
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        if args.cpu in os.sched_getaffinity(0):  # else (fewer CPUs): not pinned, and reported so
            os.sched_setaffinity(0, {args.cpu})
            pinned = sorted(os.sched_getaffinity(0))
    wall = time.monotonic()
    result = asyncio.run(load(args)) if args.mode == "load" else probe(args)
    times = os.times()
    result.update(
        cpu_s=round(times.user + times.system, 2),
        wall_s=round(time.monotonic() - wall, 2),
        pinned_cpus=pinned,
    )
    sys.stdout.write(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
