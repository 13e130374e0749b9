"""ZeroMQ CURVE for every TCP link: key files, the server side, the client side.

A key directory (`conveyor keys generate DIR`) holds, in zmq.auth's certificate format (Z85 text):

    DIR/server.key                 the server's public key  (give it to clients)
    DIR/server.key_secret          the server's key pair    (the tokenizer only)
    DIR/client.key                 a client's public key
    DIR/client.key_secret          that client's key pair   (give it to that client)
    DIR/authorized_clients/*.key   the public keys the server accepts (one file per client)
    DIR/worker.key(_secret)        the worker ranks' key pair (scheduler <-> worker socket)
    DIR/authorized_workers/*.key   the public keys the scheduler's worker socket accepts
    DIR/frontend.key(_secret)      the tokenizers' key pair (tokenizer -> scheduler socket)
    DIR/authorized_frontends/*.key the public keys the scheduler's frontend socket accepts

The scheduler serves two CURVE sockets from one context and one ZAP handler: each socket names
its ZAP domain (`WORKERS_DOMAIN`, `FRONTENDS_DOMAIN`) and each domain admits its own folder, so a
worker key cannot pose as a frontend nor a frontend key as a worker.

A CURVE server socket encrypts every connection and asks a ZAP handler (a ThreadAuthenticator
running in the socket's context) whether the client's public key is allowed; a refused client
never completes its handshake, so it can send nothing and gets nothing back. Adding a client is
copying its public `.key` file into `authorized_clients/` and restarting the server.

Only pyzmq here: services and the command line build on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from shared.env import env_path

SERVER_NAME = "server"
CLIENT_NAME = "client"
WORKER_NAME = "worker"
FRONTEND_NAME = "frontend"
AUTHORIZED_DIR = "authorized_clients"
AUTHORIZED_WORKERS_DIR = "authorized_workers"  # separate: a client key cannot pose as a worker
AUTHORIZED_FRONTENDS_DIR = "authorized_frontends"
ANY_DOMAIN = "*"  # sockets that name no ZAP domain (the tokenizer's client socket)
WORKERS_DOMAIN = "workers"  # the scheduler's worker socket
FRONTENDS_DOMAIN = "frontends"  # the scheduler's frontend socket
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


def server_public_path(keys_dir: Path) -> Path:
    return keys_dir / f"{SERVER_NAME}{PUBLIC_SUFFIX}"


def server_secret_path(keys_dir: Path) -> Path:
    return keys_dir / f"{SERVER_NAME}{SECRET_SUFFIX}"


def client_secret_path(keys_dir: Path) -> Path:
    return keys_dir / f"{CLIENT_NAME}{SECRET_SUFFIX}"


def worker_secret_path(keys_dir: Path) -> Path:
    return keys_dir / f"{WORKER_NAME}{SECRET_SUFFIX}"


def frontend_secret_path(keys_dir: Path) -> Path:
    return keys_dir / f"{FRONTEND_NAME}{SECRET_SUFFIX}"


def generate_keys(keys_dir: Path) -> list[Path]:
    """Create a server key pair, one client, one worker and one frontend key pair, and the
    `authorized_*/` folders allowing them; returns the files written. Raises FileExistsError
    rather than replace keys that clients may already hold."""
    keys_dir = Path(keys_dir)
    names = ((SERVER_NAME, None), (CLIENT_NAME, AUTHORIZED_DIR),
             (WORKER_NAME, AUTHORIZED_WORKERS_DIR),
             (FRONTEND_NAME, AUTHORIZED_FRONTENDS_DIR))  # fmt: skip
    existing = [keys_dir / f"{n}{SECRET_SUFFIX}" for n, _ in names]
    existing = [p for p in existing if p.exists()]
    if existing:
        raise FileExistsError(f"{existing[0]} exists; refusing to replace keys")
    written: list[Path] = []
    for name, authorized in names:
        keys_dir.mkdir(parents=True, exist_ok=True)
        public, secret = zmq.auth.create_certificates(keys_dir, name)
        Path(secret).chmod(0o600)  # a secret key readable by others is no secret
        written += [Path(public), Path(secret)]
        if authorized is not None:
            (keys_dir / authorized).mkdir(exist_ok=True)
            allowed = keys_dir / authorized / Path(public).name
            allowed.write_bytes(Path(public).read_bytes())
            written.append(allowed)
    return written


def load_public_key(path: Path) -> bytes:
    """The Z85 public key of a `.key` (or `.key_secret`) file; ValueError when unreadable."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a CURVE key from {path}: {exc}") from None
    return public


def load_key_pair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of a `.key_secret` file; ValueError when it has no secret."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a CURVE key from {path}: {exc}") from None
    if secret is None:
        raise ValueError(f"{path} holds no secret key (use the .key_secret file)")
    return public, secret


def load_allowed_keys(keys_dir: Path, folder: str = AUTHORIZED_DIR) -> set[bytes]:
    """The public keys in `keys_dir/folder`; ValueError when there are none (a server nobody
    may reach is a configuration mistake, not a secure default)."""
    authorized = Path(keys_dir) / folder
    if not authorized.is_dir():
        raise ValueError(
            f"{authorized} is not a directory (a folder made by `conveyor keys generate` has it)"
        )
    allowed = set(zmq.auth.load_certificates(authorized))
    if not allowed:
        raise ValueError(f"no public keys (*{PUBLIC_SUFFIX}) in {authorized}")
    return allowed


class _AllowedKeys:
    """ZAP credentials provider: a client is admitted iff its public key is listed. Called on
    the authenticator's thread, once per connection handshake."""

    def __init__(self, allowed: set[bytes], log: Any) -> None:
        self._allowed = frozenset(allowed)
        self._log = log

    def callback(self, domain: str, key: bytes) -> bool:
        """`key`: the client's public key, Z85 (as pyzmq hands it over)."""
        if key in self._allowed:
            return True
        self._log.warning("curve_client_refused", client_key=key.decode("ascii", "replace"))
        return False


def check_server_keys(keys_dir: Path, folder: str = AUTHORIZED_DIR) -> None:
    """Load the server's key pair and allowed peers (`folder`) once, so that a bad
    `--curve-keys` is a start-up error with a clear message. Raises ValueError."""
    load_key_pair(server_secret_path(Path(keys_dir)))
    load_allowed_keys(Path(keys_dir), folder)


def start_authenticator(
    context: zmq.Context,
    keys_dir: Optional[Path],
    log: Any,
    folder: str = AUTHORIZED_DIR,
    domains: Optional[dict[str, str]] = None,
) -> Optional[ThreadAuthenticator]:
    """The ZAP handler of `context`, started; None when `keys_dir` is None (no CURVE). Sockets
    without a ZAP domain admit only the public keys in `keys_dir/folder`; with `domains`
    ({ZAP domain: folder}) each named domain admits its own folder instead (and unnamed
    sockets none). Refused handshakes are logged (`curve_client_refused`). One per context,
    started before its CURVE server sockets bind, stopped after they close
    (`stop_authenticator`). Raises ValueError on bad key files."""
    if keys_dir is None:
        return None
    folders = domains if domains is not None else {ANY_DOMAIN: folder}
    providers = {d: _AllowedKeys(load_allowed_keys(Path(keys_dir), f), log)
                 for d, f in folders.items()}  # fmt: skip
    auth = ThreadAuthenticator(context)
    auth.start()
    for domain, provider in providers.items():
        auth.configure_curve_callback(domain=domain, credentials_provider=provider)
    return auth


def stop_authenticator(auth: Optional[ThreadAuthenticator]) -> None:
    if auth is not None:
        auth.stop()


def make_curve_server(
    sock: zmq.Socket, keys_dir: Optional[Path], log: Any, zap_domain: Optional[str] = None
) -> None:
    """Make `sock` (before bind) a CURVE server with the key pair in `keys_dir`; nothing when
    `keys_dir` is None. Its context needs a running authenticator (`start_authenticator`), else
    every client is admitted; `zap_domain` picks which of its folders admits peers. Raises
    ValueError on missing or bad key files."""
    if keys_dir is None:
        return
    public, secret = load_key_pair(server_secret_path(Path(keys_dir)))
    if zap_domain is not None:
        sock.zap_domain = zap_domain.encode()
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    log.info("curve_on", server_key=public.decode("ascii"))


def make_curve_client(sock: zmq.Socket, server_key: Path, client_key: Path) -> None:
    """Make `sock` (before connect) a CURVE client: `server_key` is the server's public key
    file, `client_key` this client's `.key_secret` file. Raises ValueError on bad files."""
    server_public = load_public_key(Path(server_key))
    public, secret = load_key_pair(Path(client_key))
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def make_frontend_curve_client(sock: zmq.Socket, keys_dir: Optional[Path]) -> None:
    """A tokenizer's scheduler socket (before connect): CURVE with the frontend key pair of
    `keys_dir` (the scheduler admits `authorized_frontends/`); nothing when `keys_dir` is None.
    Raises ValueError on bad key files."""
    if keys_dir is not None:
        keys = Path(keys_dir)
        make_curve_client(sock, server_public_path(keys), frontend_secret_path(keys))


def check_client_keys(server_key: Optional[Path], client_key: Optional[Path]) -> None:
    """Both or neither: a client with only one of them cannot do a CURVE handshake. Also loads
    both files, so a bad path fails when the client is built, not at its first request."""
    if (server_key is None) != (client_key is None):
        raise ValueError("server_key and client_key go together (both, or neither)")
    if server_key is not None and client_key is not None:
        load_public_key(Path(server_key))
        load_key_pair(Path(client_key))


def add_client_key_flags(parser: Any) -> None:
    """`--server-key` / `--client-key` (CONVEYOR_SERVER_KEY / CONVEYOR_CLIENT_KEY) on a
    client's parser: every client of the protocol (commands, gateway) takes the same two."""
    parser.add_argument(
        "--server-key",
        type=Path,
        default=env_path("SERVER_KEY"),
        help="CURVE: the frontend's public key file (DIR/server.key) (CONVEYOR_SERVER_KEY)",
    )
    parser.add_argument(
        "--client-key",
        type=Path,
        default=env_path("CLIENT_KEY"),
        help="CURVE: this client's key pair file (DIR/client.key_secret) (CONVEYOR_CLIENT_KEY)",
    )


def check_worker_keys(keys_dir: Optional[Path]) -> None:
    """Load a worker's key files once at start-up (ValueError with the reason)."""
    if keys_dir is not None:
        load_public_key(server_public_path(Path(keys_dir)))
        load_key_pair(worker_secret_path(Path(keys_dir)))


def check_frontend_keys(keys_dir: Optional[Path]) -> None:
    """Load a tokenizer's key files for its scheduler link once at start-up (ValueError with
    the reason; a folder made before the frontend pair existed says how to fix it)."""
    if keys_dir is None:
        return
    load_public_key(server_public_path(Path(keys_dir)))
    if not frontend_secret_path(Path(keys_dir)).exists():
        raise ValueError(
            f"{frontend_secret_path(Path(keys_dir))} is missing: the tokenizer -> scheduler link "
            "needs the frontend key pair (make a new folder with `conveyor keys generate`)"
        )
    load_key_pair(frontend_secret_path(Path(keys_dir)))
