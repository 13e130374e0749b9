"""Disaggregated prefill and decode engines (docs/design/disaggregation.md), real processes:
one stack of a prefill engine and a decode engine (SmolLM2-135M in fp32), shared by the tests
here; the session engine (colocated) is the reference.

* greedy text equals the colocated engine's, streamed and not, with the KV pulled (stats);
* the lease, spoken to the prefill engine directly as a frontend that never releases it: its
  KV reads back while the lease lasts, the lease times out (blocks freed), and the same read
  afterwards is refused (its blocks may be reused);
* a forged KV read (a lease the prefill worker does not hold, a garbled frame) is refused and
  logged, and the prefill worker goes on serving;
* with CURVE keys the KV moves; a reader with a key not admitted gets nothing, and is logged;
* `kill -9` of the decode worker during a burst of streams: every stream completes with its
  undisturbed text, the prefill engine's leases are freed within 5 s, no block is left used on
  either side.
Rough runtime: 60-100 s on the shared 2-core machine (two model loads, one reload).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from conveyor.launcher import LocalStack
from shared.client import AsyncClient, Client, Completion
from shared.curve import generate_keys, load_public_key, server_public_path
from shared.protocol.codec import decode, encode
from shared.protocol.engine_channel import OutputBatch, SubmitRequest
from shared.protocol.kv_channel import KvHandover, KvRead, KvReadReply
from shared.protocol.sampling import SamplingParams
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import ENGINE_WORKER, engine_settings, running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.model]

WAIT_S = 120.0 + SLOW_HOST_MARGIN_S
LEASE_FREED_S = 5.0  # the bound: a dead decode side's leases are gone within it
BASE = "A conveyor belt moves boxes from the loading dock to the sorting machine, and"
PROMPTS = [
    "Hi",  # shorter than a block: nothing to pull, the decode engine recomputes it
    "The speed of a conveyor belt is",
    f"{BASE} the operator checks",
    f"{BASE} {BASE} the maintenance team",
    "In a warehouse, the most common reasons a conveyor stops are",
    f"Once upon a time, {BASE} then",
]
PARAMS: dict[str, Any] = dict(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def disagg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    worker = dataclasses.replace(ENGINE_WORKER, kv_cache_memory=128 << 20)
    settings = engine_settings(
        tmp_path_factory.mktemp("disagg-logs"), gateway=False, prefill_engines=1,
        decode_engines=1, worker_config=worker,
    )  # fmt: skip
    yield from running_stack(settings)


@pytest.fixture(scope="module")
def reference(engine: Any) -> list[Completion]:
    """Each prompt's greedy completion on the colocated session engine."""
    with Client(engine.frontend_address, timeout=WAIT_S) as client:
        return [client.generate(p, **PARAMS) for p in PROMPTS]


def engine_stats(stack: LocalStack) -> dict[str, dict[str, float]]:
    with Client(stack.frontend_address, timeout=WAIT_S) as client:
        return client.stats()["engines"]


def wait_idle(stack: LocalStack, within_s: float) -> dict[str, dict[str, float]]:
    """The engines' stats once neither holds a block nor a lease (fails past `within_s`)."""
    deadline = time.monotonic() + within_s
    while True:
        stats = engine_stats(stack)
        held = {e: (s["kv_blocks_used"], s["num_leases"]) for e, s in stats.items()}
        if all(v == (0, 0) for v in held.values()):
            return stats
        assert time.monotonic() < deadline, f"blocks/leases still held: {held}"
        time.sleep(0.1)


async def streams(address: str, on_first: Any = None) -> list[list[int]]:
    """Every prompt streamed at once (twice over); once each has a chunk, `on_first()`."""
    jobs = PROMPTS + PROMPTS
    started = [asyncio.Event() for _ in jobs]
    async with AsyncClient(address, timeout=WAIT_S) as client:

        async def one(n: int) -> list[int]:
            tokens: list[int] = []
            async for chunk in client.stream(jobs[n], **PARAMS):
                tokens += chunk.token_ids
                started[n].set()
            return tokens

        tasks = [asyncio.create_task(one(n)) for n in range(len(jobs))]
        if on_first is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), WAIT_S)
            on_first()
        return list(await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S))


def log_events(stack: LocalStack, service: str, event: str) -> list[dict[str, Any]]:
    lines = (stack.log_dir / f"{service}.log").read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return [r for r in records if r.get("event") == event]


def test_greedy_text_equals_colocated(disagg: LocalStack, reference: list[Completion]) -> None:
    """Non-streamed one by one, then streamed all at once: the colocated engine's tokens."""
    before = engine_stats(disagg)["1"]
    with Client(disagg.frontend_address, timeout=WAIT_S) as client:
        for prompt, want in zip(PROMPTS, reference, strict=True):
            got = client.generate(prompt, **PARAMS)
            assert (got.token_ids, got.text) == (want.token_ids, want.text), prompt
    for n, tokens in enumerate(asyncio.run(streams(disagg.frontend_address))):
        assert tokens == reference[n % len(PROMPTS)].token_ids, PROMPTS[n % len(PROMPTS)]
    stats = wait_idle(disagg, 5.0 + SLOW_HOST_MARGIN_S)
    # each prompt ran 3 times; those with a full block (16 tokens) have KV to pull
    num_pullable = 3 * sum(want.usage["prompt_tokens"] >= 16 for want in reference)
    assert num_pullable >= 6, [want.usage for want in reference]
    decode = stats["1"]
    detail = json.dumps({k: v for k, v in decode.items() if "kv_pull" in k})
    assert decode["num_kv_pulls"] - before["num_kv_pulls"] == num_pullable, detail
    assert decode["num_kv_pull_failures"] == before["num_kv_pull_failures"], detail
    assert decode["kv_pull_bytes"] > before["kv_pull_bytes"]
    assert stats["0"]["num_leases_expired"] == 0, "a lease ran out instead of being released"
    assert stats["0"]["num_finished_handover"] >= 3 * len(PROMPTS)


def kv_read(stack: LocalStack, frame: bytes) -> list[bytes]:
    """One frame to the prefill worker's KV socket; its answer's frames."""
    assert stack.run_dir is not None
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{stack.run_dir}/worker-0-kv.sock")
    try:
        sock.send(frame)
        assert sock.poll(int(WAIT_S * 1000)), "no answer from the prefill worker"
        return sock.recv_multipart()
    finally:
        sock.close()


def hand_over_unreleased(stack: LocalStack) -> KvHandover:
    """Submit one request to the prefill engine as a frontend that will never release its
    lease; the hand-over it answers with."""
    assert stack.run_dir is not None
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{stack.run_dir}/scheduler-0.sock")
    try:
        ids = list(range(100, 140))  # 40 tokens: two full blocks
        sampling = SamplingParams(max_tokens=8, temperature=0.0)
        sock.send(encode(SubmitRequest("lease-probe", ids, sampling, hand_over=True)))
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if not sock.poll(1000):
                continue
            msg = decode(sock.recv())
            if isinstance(msg, OutputBatch):
                for out in msg.finished:
                    assert out.finish_reason == "handover" and out.handover is not None, out
                    return out.handover
        raise AssertionError("no hand-over from the prefill engine")
    finally:
        sock.close()


def test_an_unreleased_lease_times_out_and_is_never_read_after(disagg: LocalStack) -> None:
    """While the lease lasts its blocks read back (K and V of 2 blocks); past the lease
    time-out (3 s) the blocks are freed and the same read is refused."""
    ref = hand_over_unreleased(disagg)
    granted_at = time.monotonic()
    assert len(ref.block_ids) == 2 and ref.num_tokens == 32
    parts = kv_read(disagg, encode(KvRead(ref.lease_id, ref.generation)))
    head = decode(parts[0])
    assert isinstance(head, KvReadReply) and head.ok and len(parts) == 2, head
    assert head.shape[2] == 2 and len(parts[1]) > 0
    wrong = kv_read(disagg, encode(KvRead(ref.lease_id, ref.generation ^ 1)))
    assert not decode(wrong[0]).ok, "a read with another generation was served"
    while engine_stats(disagg)["0"]["num_leases"]:
        assert time.monotonic() - granted_at < 3.0 + SLOW_HOST_MARGIN_S, "the lease never ended"
        time.sleep(0.1)
    stats = wait_idle(disagg, 5.0 + SLOW_HOST_MARGIN_S)
    assert stats["0"]["num_leases_expired"] >= 1
    late = decode(kv_read(disagg, encode(KvRead(ref.lease_id, ref.generation)))[0])
    assert isinstance(late, KvReadReply) and not late.ok and late.code == "lease_unknown"


def test_forged_kv_read_is_refused_and_logged(disagg: LocalStack) -> None:
    """A read naming a lease the prefill worker does not hold (any generation), or a frame
    that is no read, gets a refusal; both are logged; the engines serve on."""
    for frame in (encode(KvRead(lease_id=10**9, generation=12345)), b"\xc1garbage"):
        parts = kv_read(disagg, frame)
        reply = decode(parts[0])
        assert isinstance(reply, KvReadReply) and not reply.ok and len(parts) == 1, reply
    # logged before each reply, but the line reaches worker-0.log through the launcher's pipe
    # and tee, which may lag the reply: wait for it, within the slow-host margin
    want, deadline = ["lease_unknown", "malformed_message"], time.monotonic() + SLOW_HOST_MARGIN_S
    codes = [r["code"] for r in log_events(disagg, "worker-0", "kv_read_refused")[-2:]]
    while codes != want and time.monotonic() < deadline:
        time.sleep(0.05)
        codes = [r["code"] for r in log_events(disagg, "worker-0", "kv_read_refused")[-2:]]
    assert codes == want
    with Client(disagg.frontend_address, timeout=WAIT_S) as client:
        assert client.generate(PROMPTS[1], **PARAMS).finish_reason == "length"


def test_decode_worker_killed_during_a_burst(
    disagg: LocalStack, reference: list[Completion]
) -> None:
    """Once every stream has a chunk, `kill -9` the decode worker and restart it (as `up`'s
    supervisor does): the decode scheduler recomputes what it held (its pulls in flight fail,
    their leases are released); every stream equals its reference; a request sent while the
    decode engine is not ready runs on the prefill engine alone (no hand-over)."""
    killed_at: list[float] = []
    held_after_kill: list[float] = []  # when the prefill engine was seen holding a lease
    done = threading.Event()

    def watch_leases() -> None:
        while not done.is_set():
            if engine_stats(disagg)["0"]["num_leases"]:
                held_after_kill.append(time.monotonic())
            time.sleep(0.05)

    alone: list[Completion] = []  # a request sent while the decode engine is not ready

    def while_decode_is_down() -> None:
        with Client(disagg.frontend_address, timeout=WAIT_S) as client:
            deadline = time.monotonic() + WAIT_S
            while client.health()["engines"][1]["ready"]:
                assert time.monotonic() < deadline, "the decode engine never said not ready"
                time.sleep(0.02)
            alone.append(client.generate(PROMPTS[3], **PARAMS, request_id="alone"))

    def kill() -> None:
        os.kill(disagg.pids()["worker-1"], signal.SIGKILL)
        killed_at.append(time.monotonic())
        threading.Thread(target=watch_leases, daemon=True).start()
        threading.Thread(target=while_decode_is_down, daemon=True).start()
        disagg.restart_workers(1)

    try:
        got = asyncio.run(streams(disagg.frontend_address, on_first=kill))
    finally:
        done.set()
    deadline = time.monotonic() + WAIT_S
    while not alone and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alone and alone[0].token_ids == reference[3].token_ids
    received = [r for r in log_events(disagg, "tokenizer", "request_received")
                if r["client_id"] == "alone"]  # fmt: skip
    rid = received[0]["rid"]
    assert received[0]["engine"] == "0"
    moved = [r for r in log_events(disagg, "tokenizer", "request_resumed") if r["rid"] == rid]
    assert moved == [], "the request was handed over while no decode engine was ready"
    for n, tokens in enumerate(got):
        assert tokens == reference[n % len(PROMPTS)].token_ids, PROMPTS[n % len(PROMPTS)]
    if held_after_kill:
        held_s = held_after_kill[-1] - killed_at[0]
        assert held_s < LEASE_FREED_S + SLOW_HOST_MARGIN_S, f"a lease held {held_s:.1f} s"
    wait_idle(disagg, 10.0 + SLOW_HOST_MARGIN_S)
    assert log_events(disagg, "scheduler-1", "worker_lost"), "the decode worker was not lost"


def test_with_curve_keys_the_kv_moves_and_an_unknown_key_is_refused(tmp_path: Path) -> None:
    """A stack with `--curve-keys`: the decode worker pulls with the worker key pair; a reader
    whose key is not in authorized_workers/ never completes the handshake (no answer), and
    the prefill worker logs the refusal."""
    keys = tmp_path / "keys"
    generate_keys(keys)
    worker = dataclasses.replace(ENGINE_WORKER, kv_cache_memory=96 << 20, max_model_len=512)
    settings = engine_settings(tmp_path / "logs", gateway=False, prefill_engines=1,
                               decode_engines=1, worker_config=worker, curve_keys=keys)  # fmt: skip
    for stack in running_stack(settings):
        server_key, client_key = stack.client_keys
        with Client(stack.frontend_address, timeout=WAIT_S, server_key=server_key,
                    client_key=client_key) as client:  # fmt: skip
            got = client.generate(PROMPTS[3], **PARAMS)
            assert client.stats()["engines"]["1"]["num_kv_pulls"] == 1
        assert got.finish_reason == "length"
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey = load_public_key(server_public_path(keys))
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.connect(f"ipc://{stack.run_dir}/worker-0-kv.sock")
        try:
            sock.send(encode(KvRead(1, 1)))
            assert not sock.poll(2000), "a reader with an unknown key was answered"
        finally:
            sock.close()
        refused = log_events(stack, "worker-0", "curve_client_refused")
        assert refused, "the refused reader was not logged"
