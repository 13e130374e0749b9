"""The client protocol, exercised from docs/protocol.md alone: raw pyzmq + msgpack, importing
nothing from the project. (~45 s, more on a busy machine: it starts three small private engines.)

Against the shared engine (`engine.frontend_address`): generate (streaming and not, every
prompt form, stop strings), abort, health, stats, and every error code a client can cause; after
each bad request a valid one succeeds on the same connection.

The codes that need the engine in a particular state (overloaded, shutting_down, worker_failed,
not_ready, engine_unreachable) are provoked on private engines started with the services'
documented commands (simulated worker, tiny limits). `internal_error` only reports bugs: no
request can cause it on purpose.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import msgpack
import pytest
import zmq

from tests.bounds import SLOW_HOST_MARGIN_S

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0
RESUME_TIMEOUT_S = 3.0  # the private engines' frontend: how long a request waits for an engine


# ---- a hand-written client, as any language would have ---------------------------------------


class Conn:
    """One DEALER connection; replies for other ids are kept until asked for."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.kept: list[dict[str, Any]] = []

    def send(self, msg: Any) -> None:
        self.sock.send(msgpack.packb(msg))

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, rid: Any, timeout: float = TIMEOUT_S) -> dict[str, Any]:
        """The next reply whose `id` is `rid` (heartbeats and unknown types are skipped)."""
        for i, msg in enumerate(self.kept):
            if msg.get("id") == rid:
                return self.kept.pop(i)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            msg = msgpack.unpackb(self.sock.recv(), raw=False)
            assert msg["v"] == 1  # every reply carries the version
            if msg["type"] not in ("chunk", "done", "error", "aborted", "health", "stats"):
                continue  # heartbeat or a type this client does not know: ignore
            if msg.get("id") == rid:
                return msg
            self.kept.append(msg)
        raise AssertionError(f"no reply for {rid!r} within {timeout} s")

    def until_end(self, rid: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(chunks, terminal reply) of one generate."""
        chunks = []
        while True:
            msg = self.recv(rid)
            if msg["type"] != "chunk":
                return chunks, msg
            chunks.append(msg)

    def generate(self, rid: Optional[str] = None, **fields: Any) -> str:
        rid = rid or uuid.uuid4().hex
        msg = {"type": "generate", "v": 1, "id": rid, **fields}
        if not any(k in fields for k in ("prompt", "messages", "prompt_token_ids")):
            msg["prompt"] = "The capital of France is"
        self.send(msg)
        return rid

    def error_code(self, rid: Any = None) -> str:
        msg = self.recv(rid)
        assert msg["type"] == "error", msg
        assert isinstance(msg["message"], str) and msg["message"]
        return msg["code"]

    def health(self) -> dict[str, Any]:
        rid = uuid.uuid4().hex
        self.send({"type": "health", "v": 1, "id": rid})
        return self.recv(rid)

    def close(self) -> None:
        self.sock.close(0)


def check_valid_request_works(conn: Conn) -> None:
    """After any bad request, the same connection is still served."""
    rid = conn.generate(params={"max_tokens": 3, "temperature": 0})
    chunks, done = conn.until_end(rid)
    assert done["type"] == "done", done
    assert done["usage"]["completion_tokens"] >= 1


@pytest.fixture
def conn(engine: Any) -> Iterator[Conn]:
    c = Conn(engine.frontend_address)
    yield c
    c.close()


# ---- generate, abort, health, stats -----------------------------------------------------------


def test_health_says_ready_with_the_models_limits(conn: Conn) -> None:
    h = conn.health()
    assert h["type"] == "health" and h["ready"] is True and h["reason"] is None
    assert isinstance(h["max_model_len"], int) and h["max_model_len"] > 0
    assert isinstance(h["vocab_size"], int) and h["vocab_size"] > 0
    assert isinstance(h["model"], str) and isinstance(h["frontend_id"], str)
    conn.send({"type": "health", "v": 1})  # the id is optional
    assert conn.recv(None)["type"] == "health"


def test_generate_not_streaming_carries_the_whole_text(conn: Conn) -> None:
    rid = conn.generate(params={"max_tokens": 5, "temperature": 0, "ignore_eos": True})
    chunks, done = conn.until_end(rid)
    assert chunks == [] and done["type"] == "done" and done["id"] == rid
    assert isinstance(done["text"], str) and len(done["token_ids"]) == 5
    assert done["finish_reason"] == "length"
    usage = done["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5 and usage["prompt_tokens"] > 0
    t = done["timings"]
    assert 0 <= t["ttft_s"] <= t["e2e_s"] and t["tpot_s"] >= 0 and t["queue_s"] >= 0


def test_generate_streaming_matches_not_streaming(conn: Conn) -> None:
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    _, whole = conn.until_end(conn.generate(params=params))
    chunks, done = conn.until_end(conn.generate(params=params, stream=True))
    assert chunks and done["type"] == "done" and "text" not in done
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert done["usage"] == whole["usage"] and all(c["logprobs"] is None for c in chunks)


def test_messages_and_token_ids_and_logprobs(conn: Conn) -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}]
    _, chat = conn.until_end(conn.generate(messages=msgs, params={"max_tokens": 4}))
    _, plain = conn.until_end(conn.generate(prompt="Say hi", params={"max_tokens": 4}))
    assert chat["type"] == plain["type"] == "done"
    assert chat["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the template
    ids = plain["token_ids"][:1] or [1]
    params = {"max_tokens": 3, "logprobs": 2, "ignore_eos": True}
    _, done = conn.until_end(conn.generate(prompt_token_ids=ids, params=params))
    assert done["usage"]["prompt_tokens"] == len(ids) and len(done["logprobs"]) == 3
    for lp in done["logprobs"]:
        assert lp["logprob"] <= 0 and len(lp["top_token_ids"]) == len(lp["top_logprobs"]) == 2


def test_stop_string_cuts_the_text(conn: Conn) -> None:
    params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    _, whole = conn.until_end(conn.generate(params=params))
    text = whole["text"]
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), f"generated text too short to pick a stop string: {text!r}"
    for stream in (False, True):
        chunks, done = conn.until_end(conn.generate(params={**params, "stop": [stop]},
                                                    stream=stream))  # fmt: skip
        got = "".join(c["text"] for c in chunks) if stream else done["text"]
        assert got == text[: text.index(stop)]
        assert done["finish_reason"] == "stop" and done["stop_reason"] == stop


def test_abort_ends_a_stream_and_is_idempotent(conn: Conn) -> None:
    params = {"max_tokens": 2000, "ignore_eos": True}
    rid = conn.generate(params=params, stream=True, prompt="Count:")
    assert conn.recv(rid)["type"] == "chunk"
    conn.send({"type": "abort", "v": 1, "id": rid})
    while (msg := conn.recv(rid))["type"] == "chunk":
        pass
    assert msg["type"] == "done" and msg["finish_reason"] == "abort"
    assert 1 <= msg["usage"]["completion_tokens"] < 2000
    ack = conn.recv(rid)
    assert ack["type"] == "aborted" and ack["found"] is True
    for unknown in (rid, "never-sent"):  # finished and unknown ids are acknowledged too
        conn.send({"type": "abort", "v": 1, "id": unknown})
        ack = conn.recv(unknown)
        assert ack["type"] == "aborted" and ack["found"] is False
    check_valid_request_works(conn)


def test_stats(conn: Conn) -> None:
    conn.send({"type": "stats", "v": 1, "id": "s1"})
    stats = conn.recv("s1")
    assert stats["type"] == "stats" and stats["ready"] is True
    assert stats["frontend"]["requests_total"] >= 0
    assert isinstance(stats["engine"], dict) and stats["engine"]
    assert all(isinstance(v, (int, float)) for v in stats["engine"].values())


# ---- every error a client can cause -----------------------------------------------------------


BAD_MESSAGES: list[tuple[Any, str]] = [
    ({"v": 1, "id": "e"}, "unknown_type"),
    ({"type": "launch", "v": 1, "id": "e"}, "unknown_type"),
    ({"type": "generate", "id": "e", "prompt": "x"}, "invalid_field"),
    ({"type": "generate", "v": 1, "prompt": "x"}, "invalid_field"),
    ({"type": "generate", "v": 1, "id": "e", "prompt": "x", "stream": "yes"}, "invalid_field"),
    ({"type": "generate", "v": 1, "id": "e", "prompt": "x", "params": [1]}, "invalid_field"),
    ({"type": "generate", "v": 2, "id": "e", "prompt": "x"}, "unsupported_version"),
    ({"type": "generate", "v": 1, "id": "e"}, "invalid_prompt"),
    ({"type": "generate", "v": 1, "id": "e", "prompt": ""}, "invalid_prompt"),
    ({"type": "generate", "v": 1, "id": "e", "prompt": "x", "prompt_token_ids": [1]},
     "invalid_prompt"),
    ({"type": "generate", "v": 1, "id": "e", "messages": [{"role": "user"}]}, "invalid_prompt"),
    ({"type": "generate", "v": 1, "id": "e", "prompt": "x", "params": {"temperature": -1}},
     "invalid_params"),
    ({"type": "generate", "v": 1, "id": "e", "prompt": "x", "params": {"top_p": 0}},
     "invalid_params"),
    ({"type": "generate", "v": 1, "id": "e", "prompt": "x", "params": {"max_tokens": 0}},
     "invalid_params"),
    ({"type": "generate", "v": 1, "id": "e", "prompt": "x", "params": {"temprature": 0}},
     "invalid_params"),
]  # fmt: skip


@pytest.mark.parametrize(("msg", "code"), BAD_MESSAGES)
def test_bad_message_gets_its_code(conn: Conn, msg: dict[str, Any], code: str) -> None:
    conn.send(msg)
    assert conn.error_code(msg.get("id")) == code
    check_valid_request_works(conn)


def test_malformed_frames(conn: Conn) -> None:
    for frames in ([b"\xc1not msgpack"], [msgpack.packb([1, 2])], [b"", msgpack.packb({})]):
        conn.send_raw(*frames)
        assert conn.error_code(None) == "malformed_message"
        check_valid_request_works(conn)


def test_frame_too_large(conn: Conn) -> None:
    conn.send({"type": "generate", "v": 1, "id": "big", "prompt": "x" * (4 << 20)})
    assert conn.error_code("big") == "frame_too_large"  # the id is read without decoding all
    check_valid_request_works(conn)


def test_limits_of_the_model(conn: Conn) -> None:
    h = conn.health()
    conn.generate("t", prompt_token_ids=[h["vocab_size"]])
    assert conn.error_code("t") == "invalid_token_id"
    check_valid_request_works(conn)
    conn.generate("l", prompt="hello", params={"max_tokens": h["max_model_len"]})
    assert conn.error_code("l") == "prompt_too_long"
    check_valid_request_works(conn)


def test_duplicate_id(conn: Conn) -> None:
    rid = conn.generate(params={"max_tokens": 2000, "ignore_eos": True}, stream=True)
    assert conn.recv(rid)["type"] == "chunk"
    conn.generate(rid, params={"max_tokens": 2})
    msg = conn.recv(rid)
    while msg["type"] == "chunk":  # the first request's chunks keep coming
        msg = conn.recv(rid)
    assert msg["type"] == "error" and msg["code"] == "duplicate_id"
    conn.send({"type": "abort", "v": 1, "id": rid})
    check_valid_request_works(conn)


# ---- engine states, on private engines --------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateEngine:
    """scheduler + simulated worker + tokenizer, as three processes from their commands."""

    def __init__(self, tmp: Path, scheduler_flags: list[str]) -> None:
        self.frontend_address = f"tcp://127.0.0.1:{free_port()}"
        sched_addr = f"ipc://{tmp}/sched.sock"
        worker_addr = f"ipc://{tmp}/worker.sock"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        py = [sys.executable, "-m"]
        commands = {
            "scheduler": [*py, "services.scheduler", "--scheduler-addr", sched_addr,
                          "--worker-addr", worker_addr, *scheduler_flags],
            "worker": [*py, "services.worker.sim", "--plan-addr", worker_addr,
                       "--sim-model", "smollm2-135m"],
            "tokenizer": [*py, "services.tokenizer", "--frontend-addr", self.frontend_address,
                          "--scheduler-addr", sched_addr, "--scheduler-timeout", "2",
                          "--drain-timeout", "30", "--resume-timeout", str(RESUME_TIMEOUT_S)],
        }  # fmt: skip
        self._commands, self._env, self._tmp = commands, env, tmp
        self.procs = {name: self._spawn(name) for name in commands}
        conn = Conn(self.frontend_address)
        deadline = time.monotonic() + 120
        while not conn.health()["ready"]:
            assert time.monotonic() < deadline, "private engine not ready"
            time.sleep(0.2)
        conn.close()

    def _spawn(self, name: str) -> subprocess.Popen[bytes]:
        log = open(self._tmp / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        return subprocess.Popen(self._commands[name], cwd=ROOT, env=self._env, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip

    def restart(self, name: str) -> None:
        self.procs[name].wait(10)
        self.procs[name] = self._spawn(name)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture
def private_engine() -> Iterator[Any]:
    made: list[PrivateEngine] = []
    with tempfile.TemporaryDirectory(prefix="conveyor-raw-") as tmp:

        def start(*scheduler_flags: str) -> PrivateEngine:
            made.append(PrivateEngine(Path(tmp), list(scheduler_flags)))
            return made[-1]

        yield start
        for eng in made:
            eng.stop()


LONG = {"max_tokens": 5000, "ignore_eos": True}


def wait_health(conn: Conn, ready: bool, within: float) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while (h := conn.health())["ready"] is not ready:
        assert time.monotonic() < deadline, f"health still {h}"
        time.sleep(0.1)
    return h


def test_overloaded_then_shutting_down(private_engine: Any) -> None:
    eng = private_engine("--max-num-seqs", "1", "--max-waiting", "1")
    conn = Conn(eng.frontend_address)
    running = conn.generate(params=LONG, stream=True)
    assert conn.recv(running)["type"] == "chunk"
    waiting = conn.generate(params=LONG, stream=True)
    conn.generate("third", params={"max_tokens": 2})
    assert conn.error_code("third") == "overloaded"
    for rid in (waiting, running):
        conn.send({"type": "abort", "v": 1, "id": rid})
    check_valid_request_works(conn)

    in_flight = conn.generate(params={"max_tokens": 1000, "ignore_eos": True}, stream=True)
    assert conn.recv(in_flight)["type"] == "chunk"
    eng.procs["tokenizer"].send_signal(signal.SIGTERM)
    assert wait_health(conn, False, 5.0 + SLOW_HOST_MARGIN_S)["reason"] == "shutting_down"
    conn.generate("late", params={"max_tokens": 2})
    assert conn.error_code("late") == "shutting_down"
    _, done = conn.until_end(in_flight)  # in-flight requests may finish during the drain
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert eng.procs["tokenizer"].wait(20) == 0
    conn.close()


def test_worker_lost_requeues_then_fails_after_the_requeue_timeout(private_engine: Any) -> None:
    """Nobody restarts the worker here: the engine says not ready at once, refuses new
    requests, and the requeued request fails `worker_failed` after the requeue time-out (3 s
    here, 30 s by default). A worker started again re-handshakes and the engine serves."""
    eng = private_engine("--requeue-timeout", "3")
    conn = Conn(eng.frontend_address)
    rid = conn.generate(params=LONG, stream=True)
    assert conn.recv(rid)["type"] == "chunk"
    eng.procs["worker"].kill()
    t0 = time.monotonic()
    # promised: not ready within 5 s of the worker's death (README, Faults)
    h = wait_health(conn, False, 5.0 + SLOW_HOST_MARGIN_S)
    assert h["reason"] == "worker_lost"
    conn.generate("after", params={"max_tokens": 2})
    assert conn.error_code("after") == "not_ready"
    _, end = conn.until_end(rid)
    assert end["type"] == "error" and end["code"] == "worker_failed"
    assert 3.0 <= time.monotonic() - t0 < 3.0 + 5.0 + SLOW_HOST_MARGIN_S
    eng.restart("worker")
    wait_health(conn, True, 30)
    check_valid_request_works(conn)
    conn.close()


def test_scheduler_lost_resumes_its_requests_or_ends_them_after_the_resume_timeout(
    private_engine: Any,
) -> None:
    """A lost scheduler ends nothing at once: restarted, it takes the in-flight request back
    and the stream goes on to its `done` (docs/protocol.md §4, docs/design/resumption.md); not
    restarted, the request ends `engine_unreachable` after the frontend's --resume-timeout."""
    eng = private_engine()
    conn = Conn(eng.frontend_address)
    medium = {"max_tokens": 100, "ignore_eos": True}
    rid = conn.generate(params=medium, stream=True)
    first = conn.recv(rid)
    assert first["type"] == "chunk"
    eng.procs["scheduler"].kill()
    assert wait_health(conn, False, 5.0 + SLOW_HOST_MARGIN_S)["reason"] == "scheduler_unreachable"
    conn.generate("after", params={"max_tokens": 2})
    assert conn.error_code("after") == "not_ready"
    eng.restart("scheduler")
    chunks, end = conn.until_end(rid)
    assert end["type"] == "done" and end["finish_reason"] == "length", end
    assert end["usage"]["completion_tokens"] == medium["max_tokens"]
    num_streamed = sum(len(c["token_ids"]) for c in [first, *chunks])
    assert num_streamed == medium["max_tokens"]  # no chunk lost or repeated
    rid = conn.generate(params=LONG, stream=True)
    assert conn.recv(rid)["type"] == "chunk"
    eng.procs["scheduler"].kill()
    t0 = time.monotonic()
    _, end = conn.until_end(rid)
    assert end["type"] == "error" and end["code"] == "engine_unreachable"
    assert time.monotonic() - t0 < RESUME_TIMEOUT_S + 2.0 + SLOW_HOST_MARGIN_S
    conn.send({"type": "stats", "v": 1, "id": "st"})
    stats = conn.recv("st", timeout=10)
    assert stats["type"] == "stats" and stats["ready"] is False and stats["engine"] is None
    conn.close()
