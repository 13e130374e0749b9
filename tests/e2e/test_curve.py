"""CURVE on the client protocol (issue 14, shared/curve.py), on a real stack: tokenizer with
`--curve-keys` made by `conveyor keys generate`, scheduler, SIMULATED worker, HTTP gateway
connecting with the generated client key pair; real processes and sockets.

* The keys `conveyor keys generate` writes load, and it refuses to overwrite them.
* With the keys: generate and stream (blocking and asyncio clients), and HTTP through the gateway.
* Without keys, with a key pair not in authorized_clients/, or expecting another server key: no
  reply at all (the handshake never completes); the unknown key is logged by the tokenizer.
* The scheduler <-> worker link is CURVE too (authorized_workers/ only): peers posing as
  worker-0 without the worker key pair (no keys, an unknown pair, a client's pair) send forged
  WorkerReady / StepResult frames that never arrive: no `worker_lost`, tokens unchanged, the
  refused keys logged by the scheduler.
* So is the tokenizer -> scheduler link (authorized_frontends/ only): a forged frontend without
  the frontend key pair (no keys, an unknown pair, a client's or the worker's pair) gets no
  answer to a StatsQuery; with the frontend pair (the healthcheck's way in) it is answered.
Rough runtime: 15-25 s on the shared machine (one stack start).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import msgpack
import pytest
import zmq
import zmq.auth

from conveyor.healthcheck import scheduler_answers
from conveyor.launcher import LocalStack, StackSettings, gateway_available
from services.gateway.config import GatewayConfig
from shared.addresses import is_local_address
from shared.client import AsyncClient, Client, EngineError
from shared.curve import (
    AUTHORIZED_DIR,
    AUTHORIZED_FRONTENDS_DIR,
    AUTHORIZED_WORKERS_DIR,
    client_secret_path,
    frontend_secret_path,
    load_key_pair,
    load_public_key,
    make_curve_client,
    server_public_path,
    worker_secret_path,
)
from shared.protocol.codec import encode
from shared.protocol.engine_channel import StatsQuery
from shared.protocol.worker_channel import StepResult, WorkerReady
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import ROOT, free_port, running_stack

pytestmark = pytest.mark.e2e

# A refused client gets nothing, ever; we watch this long (an admitted one answers in ms).
SILENCE_S = 2.0
PROMPT = "The conveyor belt carries parcels"


def _keys_generate(keys_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "keys", "generate", str(keys_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    keys = tmp_path_factory.mktemp("keys") / "engine"
    done = _keys_generate(keys)
    assert done.returncode == 0, done.stderr
    return keys


@pytest.fixture(scope="module")
def stack(keys_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    settings = StackSettings(
        worker="sim",
        frontend_address=f"tcp://127.0.0.1:{free_port()}",
        gateway=gateway_available(),
        gateway_config=GatewayConfig(http_port=free_port()),
        log_dir=tmp_path_factory.mktemp("logs"),
        drain_timeout_s=5.0,
        curve_keys=keys_dir,
    )
    yield from running_stack(settings)  # its health probes themselves go through CURVE


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A well-formed client key pair that is not in authorized_clients/."""
    folder = tmp_path_factory.mktemp("stranger")
    _, secret = zmq.auth.create_certificates(folder, "stranger")
    return Path(secret)


def _health_reply(
    address: str, wait_s: float, server_key: Optional[Path], client_key: Optional[Path]
) -> Optional[dict]:
    """A raw DEALER (CURVE when keys are given) sends `health`; its reply, or None if nothing
    arrives within `wait_s`."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if server_key is not None and client_key is not None:
            make_curve_client(sock, server_key, client_key)
        sock.connect(address)
        sock.send(msgpack.packb({"type": "health", "v": 1, "id": "curve-test"}))
        if not sock.poll(int(wait_s * 1000)):
            return None
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close()


# ---- the key files ----------------------------------------------------------------------------


def test_keys_generate_writes_loadable_keys_and_never_overwrites(keys_dir: Path) -> None:
    server_public, server_secret = load_key_pair(keys_dir / "server.key_secret")
    assert load_public_key(server_public_path(keys_dir)) == server_public
    client_public, _ = load_key_pair(client_secret_path(keys_dir))
    allowed = zmq.auth.load_certificates(keys_dir / AUTHORIZED_DIR)
    assert set(allowed) == {client_public}
    worker_public, _ = load_key_pair(worker_secret_path(keys_dir))
    assert set(zmq.auth.load_certificates(keys_dir / AUTHORIZED_WORKERS_DIR)) == {worker_public}
    assert worker_public != client_public
    frontend_public, _ = load_key_pair(frontend_secret_path(keys_dir))
    allowed_frontends = set(zmq.auth.load_certificates(keys_dir / AUTHORIZED_FRONTENDS_DIR))
    assert allowed_frontends == {frontend_public}
    assert frontend_public not in (worker_public, client_public)
    assert len(server_public) == len(server_secret) == 40  # Z85 of 32 bytes
    assert (keys_dir / "server.key_secret").stat().st_mode & 0o077 == 0  # secret: owner only
    before = (keys_dir / "server.key_secret").read_bytes()
    again = _keys_generate(keys_dir)
    assert again.returncode == 1 and "refusing" in again.stderr
    assert (keys_dir / "server.key_secret").read_bytes() == before


def test_client_refuses_half_a_key_pair(keys_dir: Path) -> None:
    with pytest.raises(ValueError, match="both"):
        Client("tcp://127.0.0.1:1", server_key=server_public_path(keys_dir))
    with pytest.raises(ValueError, match="no secret"):  # a public key where the pair belongs
        Client(
            "tcp://127.0.0.1:1",
            server_key=server_public_path(keys_dir),
            client_key=server_public_path(keys_dir),
        )


# ---- with the keys: everything works ----------------------------------------------------------


def test_with_keys_generate_and_stream(stack: LocalStack, keys_dir: Path) -> None:
    keys = {"server_key": server_public_path(keys_dir), "client_key": client_secret_path(keys_dir)}
    with Client(stack.frontend_address, timeout=30.0, **keys) as c:
        done = c.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
        streamed = c.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, stream=True)
        assert c.stats()["engine"]["num_live_requests"] == 0
    assert len(done.token_ids) == 8
    assert streamed.token_ids == done.token_ids

    async def through_async() -> list[int]:
        async with AsyncClient(stack.frontend_address, timeout=30.0, **keys) as ac:
            out = await ac.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
        return out.token_ids

    assert asyncio.run(through_async()) == done.token_ids


def test_gateway_reaches_the_curve_frontend(stack: LocalStack) -> None:
    if stack.http_url is None:
        pytest.fail("services.gateway is part of this repository and must start")
    with urllib.request.urlopen(f"{stack.http_url}/v1/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"{stack.http_url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30 + SLOW_HOST_MARGIN_S) as r:
        answer = json.load(r)
    assert answer["usage"]["completion_tokens"] == 4


# ---- without the right keys: nothing ----------------------------------------------------------


def test_right_keys_answer_within_the_silence_bound(stack: LocalStack, keys_dir: Path) -> None:
    """The control of the tests below: the same probe with the keys gets its reply."""
    reply = _health_reply(
        stack.frontend_address,
        SILENCE_S + SLOW_HOST_MARGIN_S,
        server_public_path(keys_dir),
        client_secret_path(keys_dir),
    )
    assert reply is not None and reply["type"] == "health" and reply["ready"] is True


def test_client_without_keys_gets_nothing(stack: LocalStack) -> None:
    assert _health_reply(stack.frontend_address, SILENCE_S, None, None) is None
    with Client(stack.frontend_address, timeout=SILENCE_S, connect_timeout=SILENCE_S) as c:
        with pytest.raises(EngineError) as err:
            c.generate(PROMPT, max_tokens=4)
    assert err.value.code == "engine_unreachable"


def test_unknown_client_key_refused_and_logged(
    stack: LocalStack, keys_dir: Path, stranger: Path
) -> None:
    server_key = server_public_path(keys_dir)
    assert _health_reply(stack.frontend_address, SILENCE_S, server_key, stranger) is None
    with Client(
        stack.frontend_address,
        timeout=SILENCE_S,
        connect_timeout=SILENCE_S,
        server_key=server_key,
        client_key=stranger,
    ) as c:
        with pytest.raises(EngineError) as err:
            c.generate(PROMPT, max_tokens=4)
    assert err.value.code == "engine_unreachable"
    stranger_public = load_public_key(stranger).decode()
    log = stack.log_dir / "tokenizer.log"
    deadline = time.monotonic() + SLOW_HOST_MARGIN_S
    while stranger_public not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    refused = [json.loads(line) for line in log.read_text().splitlines() if stranger_public in line]
    assert refused and refused[0]["event"] == "curve_client_refused", refused


def test_client_expecting_another_server_key_gets_nothing(
    stack: LocalStack, keys_dir: Path, stranger: Path
) -> None:
    """An impostor server (or a client with the wrong server.key): no handshake either way."""
    wrong_server = stranger.with_suffix(".key")  # some other public key
    reply = _health_reply(
        stack.frontend_address, SILENCE_S, wrong_server, client_secret_path(keys_dir)
    )
    assert reply is None


def _wait_logged(log: Path, needles: list[str]) -> None:
    deadline = time.monotonic() + SLOW_HOST_MARGIN_S
    while not all(n in log.read_text() for n in needles) and time.monotonic() < deadline:
        time.sleep(0.2)
    missing = [n for n in needles if n not in log.read_text()]
    assert not missing, f"not logged in {log.name}: {missing}"


def test_worker_link_refuses_peers_without_the_worker_key(
    stack: LocalStack, keys_dir: Path, stranger: Path
) -> None:
    keys = {"server_key": server_public_path(keys_dir), "client_key": client_secret_path(keys_dir)}
    with Client(stack.frontend_address, timeout=30.0, **keys) as c:
        want = c.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids
    forged_ready = WorkerReady(rank=0, num_blocks=1, block_size=16, max_model_len=32,
                               model_name="forged", vocab_size=10, eos_token_ids=[0],
                               dtype="float32", device="cpu")  # fmt: skip
    # Delivered, this would end the engine's state: "rank 0 said ready again" -> worker_lost.
    forged_result = StepResult(step_id=1, token_ids=[1])
    address = f"ipc://{stack.run_dir}/worker.sock"
    posers = []
    for client_key in (None, stranger, client_secret_path(keys_dir)):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"worker-0")
        if client_key is not None:
            make_curve_client(sock, server_public_path(keys_dir), client_key)
        sock.connect(address)
        sock.send(encode(forged_ready))  # queued until a handshake that never completes
        sock.send(encode(forged_result))
        posers.append(sock)
    try:
        scheduler_log = stack.log_dir / "scheduler.log"
        refused = [load_public_key(k).decode() for k in (stranger, client_secret_path(keys_dir))]
        _wait_logged(scheduler_log, refused)
    finally:
        for sock in posers:
            sock.close()
    with Client(stack.frontend_address, timeout=30.0, **keys) as c:
        assert c.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids == want
    text = scheduler_log.read_text()
    for event in ("worker_lost", "unexpected_worker_message", "result_from_unknown_identity"):
        assert f'"event":"{event}"' not in text, event


def test_frontend_link_refuses_peers_without_the_frontend_key(
    stack: LocalStack, keys_dir: Path, stranger: Path
) -> None:
    address = f"ipc://{stack.run_dir}/scheduler.sock"
    assert scheduler_answers(address, timeout=30.0, curve_keys=keys_dir)  # the frontend pair
    poser_keys = (stranger, client_secret_path(keys_dir), worker_secret_path(keys_dir))
    posers = []
    for client_key in (None, *poser_keys):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if client_key is not None:
            make_curve_client(sock, server_public_path(keys_dir), client_key)
        sock.connect(address)
        sock.send(encode(StatsQuery(query_id="forged")))  # queued: the handshake never ends
        posers.append(sock)
    try:
        scheduler_log = stack.log_dir / "scheduler.log"
        _wait_logged(scheduler_log, [load_public_key(k).decode() for k in poser_keys])
        for sock in posers:
            assert not sock.poll(int(SILENCE_S * 1000)), "a forged frontend got an answer"
    finally:
        for sock in posers:
            sock.close()
    assert scheduler_answers(address, timeout=30.0, curve_keys=keys_dir)  # still serving


def test_local_addresses() -> None:
    """What `conveyor up` warns about when it runs without keys."""
    for local in ("tcp://127.0.0.1:5557", "tcp://localhost:1", "tcp://[::1]:5", "ipc:///tmp/x"):
        assert is_local_address(local), local
    for exposed in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.0.0.3:1", "tcp://eth0:1"):
        assert not is_local_address(exposed), exposed
