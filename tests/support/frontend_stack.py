"""A real FrontendServer in this process with hand-driven peers, for the frontend's unit tests
(tests/unit/test_tokenizer_server.py, test_tokenizer_resumption.py): a DEALER client speaking
the client channel and raw schedulers (ROUTERs that answer each FrontendHello with EngineReady
while `ready` and keep what the frontend sends), turned one loop turn at a time with
`check_invariants()` after every turn. The text codec is a one-token-per-byte tokenizer.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

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
    FrontendHello,
    StatsQuery,
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

    def __init__(self, tmp: Path, num_engines: int = 2, **config: Any) -> None:
        self.ctx = zmq.Context()
        addresses = tuple(f"ipc://{tmp}/sched{i}.sock" for i in range(num_engines))
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


def stacks(tmp_prefix: str = "cv-fe-") -> Iterator[Callable[..., Stack]]:
    """The body of a `stack_of` fixture: a maker of stacks, each closed at the end; fails when
    a handler raised (the loop only logged it)."""
    made: list[Stack] = []
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp, capture_logs() as logs:
        count = iter(range(1000))

        def make(**config: Any) -> Stack:
            folder = Path(tmp) / str(next(count))
            folder.mkdir()
            made.append(Stack(folder, **config))
            return made[-1]

        yield make
        for stack in made:
            stack.close()
    failed = [e for e in logs if e["event"].endswith("_message_failed")]
    assert not failed, failed  # a handler that raised was only logged by the loop
