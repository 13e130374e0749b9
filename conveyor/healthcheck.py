"""`python -m conveyor.healthcheck KIND ADDRESS`: exit 0 when that service is healthy.

Container healthchecks (docker-compose.yml) call it; it needs only pyzmq and msgpack.
    frontend ADDR   the tokenizer answers `health` with ready=true (worker handshake done);
                    with CURVE, the key files come from CONVEYOR_SERVER_KEY / CONVEYOR_CLIENT_KEY
    scheduler ADDR  the scheduler answers a StatsQuery on its frontend socket; with CURVE, as a
                    frontend with the key folder in CONVEYOR_CURVE_KEYS (frontend.key_secret)
    http URL        the gateway answers GET URL with 200
"""

from __future__ import annotations

import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Optional

import zmq

from conveyor.launcher import probe_health
from shared.curve import make_frontend_curve_client
from shared.env import env_path
from shared.protocol.codec import DecodeError, decode, encode
from shared.protocol.engine_channel import StatsQuery, StatsReply

TIMEOUT_S = 3.0


def scheduler_answers(
    address: str, timeout: float = TIMEOUT_S, curve_keys: Optional[Path] = None
) -> bool:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        make_frontend_curve_client(sock, curve_keys)
        sock.connect(address)
        query_id = uuid.uuid4().hex
        sock.send(encode(StatsQuery(query_id=query_id)))
        while sock.poll(int(timeout * 1000)):
            try:
                reply = decode(sock.recv())
            except DecodeError:
                return False
            if isinstance(reply, StatsReply) and reply.query_id == query_id:
                return True
        return False
    finally:
        sock.close()


def http_ok(url: str, timeout: float = TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - local
            return response.status == 200
    except OSError:
        return False


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("frontend", "scheduler", "http"):
        print(__doc__, file=sys.stderr)
        return 2
    kind, target = args
    if kind == "frontend":
        keys = (env_path("SERVER_KEY"), env_path("CLIENT_KEY"))
        ok = probe_health(target, TIMEOUT_S, *keys)
    elif kind == "scheduler":
        ok = scheduler_answers(target, curve_keys=env_path("CURVE_KEYS"))
    else:
        ok = http_ok(target)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
