"""The clients' shared sans-I/O core (shared/client/core.py): frames it builds decode as the
frontend decodes them, and replies are routed per id, by kind, and dropped once abandoned.
Replies are built with the frontend's own encoders (shared/protocol/client_channel/)."""

from __future__ import annotations

import msgpack
import pytest

from shared.client.core import ABORT_KINDS, RESULT_KINDS, STREAM_KINDS, ClientCore
from shared.client.types import Chunk, Done, EngineError
from shared.protocol import client_channel as cc


def _wire(frame: bytes) -> dict:
    return msgpack.unpackb(frame, raw=False)


def _chunk(rid: str, text: str) -> bytes:
    return msgpack.packb({"type": "chunk", "v": 1, "id": rid, "text": text, "token_ids": [1]})


def _done(rid: str) -> bytes:
    return msgpack.packb({"type": "done", "v": 1, "id": rid, "finish_reason": "stop",
                          "usage": {}, "timings": {}, "text": "hi", "token_ids": [1]})  # fmt: skip


def test_generate_and_query_frames() -> None:
    core = ClientCore("tcp://x:1", timeout=5, connect_timeout=9, resume_timeout=0)
    assert core.connect_timeout == 5  # never longer than the timeout
    rid, frame = core.generate(None, "hello", None, None, True, 2, {"max_tokens": 4, "seed": None})
    wire = _wire(frame)
    assert wire["type"] == "generate" and wire["id"] == rid and wire["stream"] is True
    assert wire["params"] == {"max_tokens": 4} and wire["priority"] == 2
    qid, frame = core.query("stats")
    assert _wire(frame) == {"type": "stats", "v": 1, "id": qid} and core.is_open(qid)
    with pytest.raises(ValueError):
        ClientCore("tcp://x:1", timeout=0, connect_timeout=1)


def test_replies_are_routed_by_id_and_taken_by_kind() -> None:
    core = ClientCore("tcp://x:1", 5, 5)
    core.open("a")
    core.open("b")
    assert core.receive(_chunk("b", "B")) == "b"
    assert core.receive(_chunk("a", "A1")) == "a"
    assert core.receive(_done("a")) == "a"
    assert core.receive(_chunk("zz", "?")) is None  # nobody waits for it
    assert core.receive(b"\x00not msgpack") is None
    assert core.receive(msgpack.packb({"type": "heartbeat", "v": 1})) is None
    assert core.take("a", ABORT_KINDS) is None  # other kinds stay
    first = core.stream_event(core.take("a", STREAM_KINDS) or {})
    assert isinstance(first, Chunk) and first.text == "A1"
    assert isinstance(core.stream_event(core.take("a", STREAM_KINDS) or {}), Done)
    other = core.stream_event(core.take("b", STREAM_KINDS) or {})
    assert isinstance(other, Chunk) and other.text == "B"
    assert core.take("b", STREAM_KINDS) is None
    core.open("c")
    core.receive(cc.error_reply("bad_request", "nope", "c"))
    with pytest.raises(EngineError) as info:
        core.completion(core.take("c", RESULT_KINDS) or {})
    assert info.value.code == "bad_request"


def test_abandoned_replies_are_dropped_until_aborted() -> None:
    core = ClientCore("tcp://x:1", 5, 5)
    assert core.abandon("never-opened") is None
    core.open("a")
    frame = core.abandon("a")
    assert frame is not None and _wire(frame) == {"type": "abort", "v": 1, "id": "a"}
    assert core.receive(_chunk("a", "late")) is None
    assert core.receive(cc.aborted_reply("a", True)) is None  # ends the dropping
    opened, frame = core.abort("a")  # a later abort() of the same id waits for its own reply
    assert opened and _wire(frame)["type"] == "abort"
    assert core.receive(cc.aborted_reply("a", False)) == "a"
    assert core.take("a", ABORT_KINDS)["found"] is False  # type: ignore[index]


def test_abort_shares_a_live_streams_box() -> None:
    core = ClientCore("tcp://x:1", 5, 5)
    core.open("s")
    opened, _ = core.abort("s")
    assert not opened  # the stream keeps its box and still gets its `done`
    core.receive(cc.aborted_reply("s", True))
    core.receive(_done("s"))
    assert core.take("s", ABORT_KINDS)["found"] is True  # type: ignore[index]
    assert core.take("s", STREAM_KINDS)["type"] == "done"  # type: ignore[index]
