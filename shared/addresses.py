"""The default addresses of a one-machine engine, in one place.

Every service's flag default, the launcher, the clients and the command line take them from
here (a deployment sets them with flags or CONVEYOR_*_ADDR; compose/*.env does).
"""

from __future__ import annotations

from shared.env import env_str

DEFAULT_SCHEDULER_ADDR = "tcp://127.0.0.1:5556"  # scheduler ROUTER <- tokenizer frontends
DEFAULT_FRONTEND_ADDR = "tcp://127.0.0.1:5557"  # tokenizer ROUTER <- clients (docs/protocol.md)
DEFAULT_WORKER_ADDR = "tcp://127.0.0.1:5558"  # scheduler ROUTER <- worker ranks
DEFAULT_HTTP_HOST = "127.0.0.1"  # the OpenAI-compatible gateway
DEFAULT_HTTP_PORT = 8000


def default_frontend_address() -> str:
    """Where clients look for an engine: CONVEYOR_FRONTEND_ADDR, else what `conveyor up` binds."""
    return env_str("FRONTEND_ADDR", DEFAULT_FRONTEND_ADDR) or DEFAULT_FRONTEND_ADDR


def is_local_address(address: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback host: only this machine can connect.
    `*`, 0.0.0.0, interface names and other hosts are reachable from elsewhere."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    return is_loopback_host(rest.rsplit(":", 1)[0])


def is_loopback_host(host: str) -> bool:
    """True for a loopback host name or address (`[::1]` with or without brackets)."""
    host = host.strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
