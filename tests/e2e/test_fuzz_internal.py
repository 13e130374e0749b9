"""Fuzzing the internal sockets without CURVE (issue 34): the scheduler's frontend socket and
worker socket (a live stack, simulated worker with zero-cost steps), and the worker's plan
socket (the REAL worker on the tiny random model, its scheduler played by the test).

Frames (tests/support/fuzz_frames.py, seeded): random msgpack values, random bytes, valid
messages with 1-3 fields set to random values, deleted or added, messages of the wrong
channel, byte-level mutations of all of these; for the worker, plans that skip or repeat step
ids. Each must be dropped (or answered) with a stable code, never crash a process: every frame
the test's own decoder refuses is logged by the scheduler with the same code (or answered by
the worker's `WorkerFailure` with it), no receive boundary catches an exception, and afterwards
the engine (the worker) serves a valid request with exactly the tokens it gave before.
CONVEYOR_FUZZ_INTERNAL_FRAMES sets the frames per scheduler socket (default 2,000; the worker
gets half as many). Rough runtime: 10-30 s on the shared 2-core machine.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import msgpack
import pytest
import zmq

from conveyor.launcher import LocalStack, StackSettings
from services.scheduler.server_config import ServerConfig
from services.worker.sim.config import SimConfig
from shared.client import Client
from shared.env import env_int
from shared.protocol.codec import DecodeError, decode, encode
from shared.protocol.engine_channel import (
    AbortRequest,
    EngineReady,
    FrontendBye,
    FrontendHello,
    OutputBatch,
    RequestOutput,
    ResetPrefixCache,
    StatsQuery,
    StatsReply,
    SubmitRequest,
)
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import (
    NewSequence,
    StepPlan,
    StepResult,
    WorkerFailure,
    WorkerReady,
)
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import ROOT, free_port
from tests.support.fuzz_frames import fuzz_frames
from tests.support.tiny_model import write_tiny_model

pytestmark = pytest.mark.e2e

NUM_FRAMES = env_int("FUZZ_INTERNAL_FRAMES", 2000) or 2000
BATCH = 100
ANSWER_WITHIN_S = 10.0 + SLOW_HOST_MARGIN_S  # a frame is handled within a loop turn
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# What the scheduler's frontend socket handles (a valid frame of these is served, not dropped)
FRONTEND_HANDLED = (SubmitRequest, AbortRequest, FrontendHello, StatsQuery, FrontendBye,
                    ResetPrefixCache)  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    settings = StackSettings(
        worker="sim", sim_config=SimConfig(device="none"), gateway=False,
        frontend_address=f"tcp://127.0.0.1:{free_port()}",
        log_dir=tmp_path_factory.mktemp("logs"),
    )  # fmt: skip
    st = LocalStack(settings).start()
    try:
        st.wait_ready(timeout=180)
        yield st
    finally:
        st.stop()


def _log(stack: LocalStack, service: str) -> list[dict[str, Any]]:
    text = Path(stack.log_dir, f"{service}.log").read_text(errors="replace")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _codes(records: list[dict[str, Any]], events: tuple[str, ...]) -> Counter[str]:
    return Counter(r.get("code", "?") for r in records if r.get("event") in events)


def _expected_drop(
    frame: bytes, max_size: Optional[int], handled: tuple[type, ...], other: str
) -> str:
    """What the receiver must log for `frame`: its DecodeError code, `other` (a message of a
    type it does not take), or "" (a valid message it serves)."""
    try:
        msg = decode(frame, max_size=max_size)
    except DecodeError as exc:
        return exc.code
    return "" if isinstance(msg, handled) else other


def _reference(stack: LocalStack) -> list[int]:
    with Client(stack.frontend_address, timeout=30.0) as c:
        return c.generate("the same before and after", max_tokens=8, temperature=0.0).token_ids


def _valid_frontend_messages() -> list[Any]:
    sampling = SamplingParams(max_tokens=3)
    return [
        SubmitRequest("fz-1", [1, 2, 3], sampling, 0, 0.0, [4], 1),
        AbortRequest("fz-1"), FrontendHello("fuzz"), StatsQuery("q"), ResetPrefixCache("r"),
    ]  # fmt: skip


def _foreign_messages() -> list[Any]:
    return [
        OutputBatch(3, ["a"], [1], finished=[RequestOutput("b", [2], "stop")]),
        EngineReady("m", 64, 100, [0], 8, 16), StatsReply("q", {"x": 1.0}),
        StepPlan(9, 8, 1, 1, count_slots=[0], counts=[1]), StepResult(9, [5]),
    ]  # fmt: skip


def test_the_scheduler_frontend_socket_drops_bad_frames_with_a_code(stack: LocalStack) -> None:
    want = _reference(stack)
    assert stack.run_dir is not None
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"fuzz-frontend")
    sock.connect(f"ipc://{stack.run_dir}/scheduler.sock")
    rnd = random.Random(34)
    max_size = ServerConfig().max_frame_bytes
    frames = fuzz_frames(rnd, _valid_frontend_messages(), _foreign_messages(), NUM_FRAMES)
    frames.append(b"\x91" + b"\xc4\x00" * (max_size // 2 + 1))  # over the frame limit
    expected: Counter[str] = Counter()
    try:
        for start in range(0, len(frames), BATCH):
            batch = frames[start : start + BATCH]
            for frame in batch:
                sock.send(frame)
                expected[_expected_drop(frame, max_size, FRONTEND_HANDLED, "unexpected_type")] += 1
            sock.send(encode(FrontendBye("fuzz")))  # its valid requests end with it
            _until_stats_reply(sock, f"marker-{start}")
    finally:
        sock.close()
    del expected[""]
    got = _codes(_log(stack, "scheduler"), ("bad_frontend_frame", "unexpected_frontend_message"))
    assert got == expected  # every bad frame logged once, with its own code
    assert {"malformed_message", "unknown_type", "invalid_field", "frame_too_large"} <= set(got)
    print(f"\nscheduler frontend socket: {len(frames)} frames, drops {dict(got)}")  # RELIABILITY
    _served_after(stack, want)


def _until_stats_reply(sock: zmq.Socket, qid: str) -> None:
    """The scheduler answers in order: once the marker's StatsReply is back, the batch was
    handled. Everything else it sent (outputs, refusals, hellos' answers) is read past."""
    sock.send(encode(StatsQuery(qid)))
    deadline = time.monotonic() + ANSWER_WITHIN_S
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000)), "the scheduler stopped answering"
        msg = decode(sock.recv())
        if isinstance(msg, StatsReply) and msg.query_id == qid:
            return


def test_the_scheduler_worker_socket_drops_bad_frames_with_a_code(stack: LocalStack) -> None:
    want = _reference(stack)
    assert stack.run_dir is not None
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"fuzz-worker")
    sock.connect(f"ipc://{stack.run_dir}/worker.sock")
    rnd = random.Random(35)
    valid = [WorkerReady(0, 64, 16, 256, "m", 100, [0], "float32", "cpu"), StepResult(1, [3]),
             WorkerFailure(1, "worker_failed", "x")]  # fmt: skip
    frames = fuzz_frames(rnd, valid, _valid_frontend_messages(), NUM_FRAMES)
    frames += [encode(StepResult(step, [1, 2])) for step in (0, 10**9, -1, 2)]  # out of order
    before = sum(_codes(_log(stack, "scheduler"), _WORKER_DROPS).values())
    try:
        for frame in frames:
            sock.send(frame)
        deadline = time.monotonic() + ANSWER_WITHIN_S + len(frames) / 1000
        while True:  # no answer comes to a peer that is no rank: count the log's drops
            got = _codes(_log(stack, "scheduler"), _WORKER_DROPS)
            if sum(got.values()) - before >= len(frames) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        sock.close()
    assert sum(got.values()) - before == len(frames)  # each frame dropped once, with a code
    decode_codes = Counter(c for f in frames if (c := _expected_drop(f, None, (object,), "")))
    assert all(got[code] >= n for code, n in decode_codes.items()), (got, decode_codes)
    records = _log(stack, "scheduler")
    assert not [r for r in records if r.get("event") == "worker_lost"]  # its leaving: no loss
    print(f"\nscheduler worker socket: {len(frames)} frames, drops {dict(got)}")  # RELIABILITY
    _served_after(stack, want)


_WORKER_DROPS = ("bad_worker_frame", "worker_frame_dropped")


def _served_after(stack: LocalStack, want: list[int]) -> None:
    assert stack.is_ready(), "the engine is not ready after the fuzz"
    assert _reference(stack) == want
    for name in ("tokenizer", "scheduler", "worker"):
        text = Path(stack.log_dir, f"{name}.log").read_text(errors="replace")
        assert "_message_failed" not in text and "Traceback" not in text, name


# ---- the worker's plan socket --------------------------------------------------------------


class FakeScheduler:
    """A ROUTER the real worker connects to; the test sends it plans by hand."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.ready: Optional[WorkerReady] = None

    def wait_ready(self, proc: subprocess.Popen, timeout: float) -> WorkerReady:
        deadline = time.monotonic() + timeout
        while self.ready is None:
            assert proc.poll() is None, "the worker exited before its handshake"
            assert time.monotonic() < deadline, "no WorkerReady"
            if self.sock.poll(200):
                _ident, frame = self.sock.recv_multipart()
                msg = decode(frame)
                if isinstance(msg, WorkerReady):
                    self.ready = msg
        return self.ready

    def ask(self, frame: bytes) -> Any:
        """Send one frame; the worker's one answer (a StepResult or a WorkerFailure)."""
        self.sock.send_multipart([b"worker-0", frame])
        assert self.sock.poll(int(ANSWER_WITHIN_S * 1000)), "the worker did not answer"
        _ident, reply = self.sock.recv_multipart()
        return decode(reply)


def _reset_plan(step_id: int) -> StepPlan:
    seq = NewSequence("fz", [5, 6, 7, 8, 9], 5, [0], GREEDY, slot=0)
    return StepPlan(step_id, None, 1, 5, new_seqs=[seq], count_slots=[0], counts=[5])


def _plans(ready: WorkerReady) -> list[Any]:
    """Seeds: plans that fit, and plans that skip or repeat steps (out of order)."""
    seq = NewSequence("fz2", [3, 4], 2, [1], GREEDY, slot=1)
    return [
        _reset_plan(100), StepPlan(101, 100, 1, 1), StepPlan(7, 3, 1, 1),
        StepPlan(102, None, 1, 2, new_seqs=[seq], count_slots=[1], counts=[2]),
        StepPlan(103, 103, 2, 2, block_slots=[0], block_ids=[ready.num_blocks - 1]),
    ]  # fmt: skip


def test_the_worker_plan_socket_answers_bad_frames_with_a_code(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny")
    address = f"ipc://{tmp_path}/plans.sock"
    fake = FakeScheduler(address)
    log_path = tmp_path / "worker.log"
    argv = [
        sys.executable,
        "-m",
        "services.worker",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "8MiB",
        "--max-model-len",
        "256",
        "--attention-backend",
        "torch",
        "--worker-addr",
        address,
        "--log-format",
        "json",
    ]
    with log_path.open("w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        ready = fake.wait_ready(proc, 120.0)
        first = fake.ask(encode(_reset_plan(1)))
        assert isinstance(first, StepResult) and len(first.token_ids) == 1
        rnd = random.Random(36)
        frames = fuzz_frames(rnd, _plans(ready), [ready, StepResult(1, [2]), AbortRequest("x")],
                             NUM_FRAMES // 2)  # fmt: skip
        replies: Counter[str] = Counter()
        for frame in frames:
            if _is_shutdown(frame):
                continue  # a valid WorkerShutdown stops the worker, as it must
            reply = fake.ask(frame)
            assert isinstance(reply, (StepResult, WorkerFailure)), reply
            code = _expected_drop(frame, None, (StepPlan,), "unknown_type")
            if code:  # undecodable, or not a plan: answered with its own code
                assert isinstance(reply, WorkerFailure) and reply.code == code, (code, reply)
            replies[reply.code if isinstance(reply, WorkerFailure) else "result"] += 1
        again = fake.ask(encode(_reset_plan(10_000)))
        assert isinstance(again, StepResult) and again.token_ids == first.token_ids
        assert proc.poll() is None
        print(f"\nworker plan socket: {sum(replies.values())} frames, answers {dict(replies)}")
    finally:
        proc.kill()
        proc.wait(30)
        fake.sock.close()
    assert replies["internal_error"] == 0  # no frame reached the receive boundary
    text = log_path.read_text(errors="replace")
    assert "worker_message_failed" not in text, text[-3000:]


def _is_shutdown(frame: bytes) -> bool:
    try:
        wire = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - not msgpack: not a shutdown
        return False
    return isinstance(wire, dict) and wire.get("type") == "worker_shutdown"
