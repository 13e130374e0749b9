"""The frontend's parts keep their invariants through every way a request lives and ends
(services/tokenizer/server.py and the parts it wires): a real FrontendServer in this process,
turned one loop turn at a time over real sockets, with `check_invariants()` after every turn.

Its peers speak the wire protocols by hand: a DEALER client (the client channel) and two raw
schedulers, ROUTERs that answer each FrontendHello with EngineReady and send what the test
says (as tests/e2e/test_engine_routing.py drives the scheduler with raw frontends). The text
codec is a one-token-per-byte tokenizer. Rough runtime: 1-2 s.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import structlog
import zmq
from structlog.testing import capture_logs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.tokenizer.config import FrontendConfig
from services.tokenizer.router import RouterConfig
from services.tokenizer.server import FrontendServer
from services.tokenizer.text_codec import TextCodec
from shared.protocol import client_channel as cc
from shared.protocol.codec import decode, encode
from shared.protocol.engine_channel import (
    AbortRequest,
    EngineReady,
    EngineShutdown,
    FrontendBye,
    FrontendHello,
    OutputBatch,
    RequestOutput,
    RequestRejected,
    StatsQuery,
    StatsReply,
    SubmitRequest,
)
from tests.bounds import SLOW_HOST_MARGIN_S

READY = EngineReady("bytes", max_model_len=1024, vocab_size=300, eos_token_ids=[],
                    num_blocks=64, block_size=16)  # fmt: skip


def byte_codec() -> TextCodec:
    """One token per byte (GPT-2 byte-level alphabet), no chat template."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return TextCodec(tok, None)


class RawScheduler:
    """A scheduler's ROUTER: answers hellos with EngineReady while `ready`, keeps the rest."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.frontend: Optional[bytes] = None
        self.ready = True
        self.got: list[Any] = []

    def serve(self) -> None:
        while self.sock.poll(0):
            self.frontend, frame = self.sock.recv_multipart()
            msg = decode(frame)
            if not isinstance(msg, FrontendHello):
                self.got.append(msg)
            elif self.ready:
                self.send(READY)

    def send(self, msg: Any) -> None:
        assert self.frontend is not None
        self.sock.send_multipart([self.frontend, encode(msg)])

    def submitted(self) -> list[str]:
        return [m.rid for m in self.got if isinstance(m, SubmitRequest)]

    def aborted(self) -> dict[str, str]:
        return {m.rid: m.reason for m in self.got if isinstance(m, AbortRequest)}


class RawClient:
    """A DEALER speaking the client channel; `replies` keeps all but heartbeats, in order."""

    def __init__(self, ctx: zmq.Context, address: str, name: bytes) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.replies: list[dict[str, Any]] = []

    def send(self, kind: str, id: Optional[str], **fields: Any) -> None:
        self.sock.send(cc.encode_client_message(kind, id, **fields))

    def generate(self, id: str, stream: bool = True) -> None:
        self.send("generate", id, prompt_token_ids=[70, 71, 72], stream=stream,
                  params={"max_tokens": 16})  # fmt: skip

    def serve(self) -> None:
        while not self.sock.closed and self.sock.poll(0):
            reply = cc.decode_reply(self.sock.recv())
            if reply["type"] != "heartbeat":
                self.replies.append(reply)

    def of(self, id: str) -> list[dict[str, Any]]:
        return [r for r in self.replies if r.get("id") == id]


class Stack:
    """The server and its peers, turned together; every turn ends with check_invariants()."""

    def __init__(self, tmp: Path, **config: Any) -> None:
        self.ctx = zmq.Context()
        addresses = tuple(f"ipc://{tmp}/sched{i}.sock" for i in range(2))
        cfg = FrontendConfig(
            frontend_address=f"ipc://{tmp}/fe.sock", scheduler_addresses=addresses,
            frontend_id="fe-t", heartbeat_s=0.1, router=RouterConfig("round-robin"), **config,
        )  # fmt: skip
        self.engines = [RawScheduler(self.ctx, a) for a in addresses]
        self.server = FrontendServer(cfg, byte_codec(), structlog.get_logger("test"), self.ctx)
        self.server.open()
        self.client = RawClient(self.ctx, cfg.frontend_address, b"client-1")

    def pump(self, until: Callable[[], bool], what: str) -> None:
        """Turn the server (until it stopped) and serve the peers until `until()`."""
        deadline = time.monotonic() + 2.0 + SLOW_HOST_MARGIN_S
        while not until():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            if self.server.stopped:
                time.sleep(0.005)
            else:
                self.server.turn(5)
                self.server.check_invariants()
            for peer in (*self.engines, self.client):
                peer.serve()

    def wait_all_ready(self) -> None:
        """Ask `health` until it says both engines are ready."""
        deadline = time.monotonic() + 2.0 + SLOW_HOST_MARGIN_S
        while time.monotonic() < deadline:
            self.client.send("health", "h")
            self.pump(lambda: bool(self.client.of("h")), "a health reply")
            health = self.client.of("h")[-1]
            self.client.replies.clear()
            if all(e["ready"] for e in health["engines"]):
                return
        raise AssertionError("the engines never became ready")

    def num_submitted(self) -> int:
        return sum(len(e.submitted()) for e in self.engines)

    def queries(self, engine: int) -> list[str]:
        return [m.query_id for m in self.engines[engine].got if isinstance(m, StatsQuery)]

    def close(self) -> None:
        self.server.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def stack_of() -> Iterator[Callable[..., Stack]]:
    made: list[Stack] = []
    with tempfile.TemporaryDirectory(prefix="cv-fe-") as tmp, capture_logs() as logs:

        def make(**config: Any) -> Stack:
            made.append(Stack(Path(tmp), **config))
            return made[-1]

        yield make
        for stack in made:
            stack.close()
    failed = [e for e in logs if e["event"].endswith("_message_failed")]
    assert not failed, failed  # a handler that raised was only logged by the loop


def test_a_request_lives_on_one_engine_until_done(stack_of: Callable[..., Stack]) -> None:
    s = stack_of()
    s.wait_all_ready()
    s.client.generate("a")
    s.pump(lambda: bool(s.engines[0].submitted()), "the request at engine 0")
    (rid,) = s.engines[0].submitted()
    assert s.engines[1].submitted() == []
    s.client.generate("a")  # the same id again while in flight
    s.client.send("stats", "st")
    s.pump(lambda: bool(s.queries(0)) and bool(s.queries(1)), "the stats queries")
    for i, engine in enumerate(s.engines):
        engine.send(StatsReply(s.queries(i)[0], {"num_running": 1.0}))
    s.pump(lambda: bool(s.client.of("st")), "the stats reply")
    stats = s.client.of("st")[0]
    assert stats["frontend"]["requests_in_flight"] == 1.0 and stats["engine"]["num_running"] == 2
    assert [r["code"] for r in s.client.of("a")] == ["duplicate_id"]
    s.engines[0].send(OutputBatch(1, [rid], [65]))
    s.engines[0].send(OutputBatch(2, finished=[RequestOutput(rid, [66], "length")]))
    s.pump(lambda: any(r["type"] == "done" for r in s.client.of("a")), "the done")
    kinds = [r["type"] for r in s.client.of("a")]
    assert kinds == ["error", "chunk", "chunk", "done"], kinds
    s.client.send("stats", "st2")
    s.pump(lambda: len(s.queries(0)) == len(s.queries(1)) == 2, "the second queries")
    for i, engine in enumerate(s.engines):
        engine.send(StatsReply(s.queries(i)[1], {"num_running": 0.0}))
    s.pump(lambda: bool(s.client.of("st2")), "the second stats reply")
    frontend = s.client.of("st2")[0]["frontend"]
    assert frontend["requests_in_flight"] == 0.0 and frontend["requests_total"] == 1.0
    assert frontend["num_finished_1m"] == 1.0 and frontend["errors_total"] == 1.0


def test_engine_loss_moves_what_streamed_nothing_and_fails_the_rest(
    stack_of: Callable[..., Stack],
) -> None:
    s = stack_of()
    s.wait_all_ready()
    for i, name in enumerate(("a", "b", "c")):  # round-robin: engines 0, 1, 0
        s.client.generate(name)
        s.pump(lambda i=i: s.num_submitted() == i + 1, f"{name}'s submission")
    rid_a, rid_c = s.engines[0].submitted()
    (rid_b,) = s.engines[1].submitted()
    s.engines[0].send(OutputBatch(1, [rid_a], [65]))  # a streamed a token, c nothing
    s.pump(lambda: bool(s.client.of("a")), "a's first chunk")
    s.engines[0].ready = False
    s.engines[0].send(EngineShutdown("test"))
    s.pump(lambda: rid_c in s.engines[1].submitted() and len(s.client.of("a")) == 2, "the move")
    assert s.client.of("a")[-1]["code"] == "engine_unreachable"
    s.pump(lambda: len(s.engines[0].aborted()) == 2, "the aborts at the lost engine")
    assert s.engines[0].aborted() == {rid_a: "engine_lost", rid_c: "engine_lost"}
    s.engines[0].send(OutputBatch(2, [rid_c], [65]))  # the old engine's output: dropped
    s.engines[1].send(RequestRejected(rid_b, "overloaded", "full"))
    s.engines[1].send(OutputBatch(1, finished=[RequestOutput(rid_c, [66, 67], "length")]))
    s.pump(lambda: bool(s.client.of("b")) and bool(s.client.of("c")), "b and c ended")
    assert [r["code"] for r in s.client.of("b")] == ["overloaded"]
    c_frames = s.client.of("c")
    assert [r["type"] for r in c_frames] == ["chunk", "done"]
    assert c_frames[0]["token_ids"] == [66, 67]  # nothing from the lost engine


def test_abort_a_client_gone_and_drain_close_every_request(
    stack_of: Callable[..., Stack],
) -> None:
    s = stack_of()
    s.wait_all_ready()
    other = RawClient(s.ctx, s.server.config.frontend_address, b"client-2")
    for name in ("x", "y"):
        s.client.generate(name, stream=False)
    other.generate("p")
    s.pump(lambda: s.num_submitted() == 3, "three submissions")
    s.client.send("abort", "x")
    s.client.send("abort", "zz")
    s.pump(lambda: len(s.client.of("x")) == 2 and bool(s.client.of("zz")), "the aborts")
    assert [(r["type"], r.get("finish_reason")) for r in s.client.of("x")] == [
        ("done", "abort"), ("aborted", None)]  # fmt: skip
    assert s.client.of("zz")[0]["found"] is False
    other.sock.close()  # its request ends when a heartbeat to it fails
    reasons = lambda: {**s.engines[0].aborted(), **s.engines[1].aborted()}  # noqa: E731
    s.pump(lambda: len(reasons()) == 2, "the abort and the gone client's abort")
    assert sorted(reasons().values()) == ["abort", "client_gone"]
    s.server.request_drain()
    s.client.generate("late")
    s.pump(lambda: bool(s.client.of("late")), "the refusal")
    assert s.client.of("late")[0]["code"] == "shutting_down"
    (rid_y,) = [r for e in s.engines for r in e.submitted() if r not in reasons()]
    holder = next(e for e in s.engines if rid_y in e.submitted())
    holder.send(OutputBatch(1, finished=[RequestOutput(rid_y, [66], "stop")]))
    s.pump(lambda: s.server.stopped, "the drained stop")
    assert s.client.of("y")[0]["type"] == "done"
    s.pump(lambda: all(any(isinstance(m, FrontendBye) for m in e.got) for e in s.engines),
           "the byes")  # fmt: skip


def test_a_drain_past_its_grace_fails_what_is_open(stack_of: Callable[..., Stack]) -> None:
    s = stack_of(drain_timeout_s=0.0)
    s.wait_all_ready()
    s.client.generate("a")
    s.pump(lambda: bool(s.engines[0].submitted()), "the submission")
    s.server.request_drain()
    s.pump(lambda: s.server.stopped, "the forced stop")
    (rid,) = s.engines[0].submitted()
    s.pump(lambda: bool(s.client.of("a")), "the failure")
    assert [r["code"] for r in s.client.of("a")] == ["shutting_down"]
    s.pump(lambda: s.engines[0].aborted() == {rid: "shutdown"}, "the engine's abort")
