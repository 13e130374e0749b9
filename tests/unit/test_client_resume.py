"""What the clients keep to resume their requests on a new connection (shared/client/resume.py
through ClientCore): streams come back with `resume` (the token ids and text their chunks
brought), requests with no chunk and queries as they were sent, pending aborts after them;
ended or abandoned ones not at all; one resumed too often fails with `engine_unreachable`; a
sampled request without a seed gets one. The frames decode as the frontend decodes them."""

from __future__ import annotations

import time

import msgpack
import pytest

from shared.client.core import STREAM_KINDS, ClientCore
from shared.client.resume import DEFAULT_MAX_RESUMES, RETRY_S, pin_seed
from shared.client.types import EngineError
from shared.protocol import client_channel as cc


def _chunk(rid: str, text: str, ids: list[int]) -> bytes:
    return msgpack.packb({"type": "chunk", "v": 1, "id": rid, "text": text, "token_ids": ids})


def _sent(core: ClientCore, rid: str, stream: bool = True) -> None:
    _rid, frame = core.generate(rid, "hello", None, None, stream, 0, {"max_tokens": 9})
    core.open(rid, frame)


def test_open_requests_come_back_with_what_they_have() -> None:
    core = ClientCore(["tcp://a:1", "tcp://b:1"], 5, 5)
    _sent(core, "s")  # a stream with two chunks
    _sent(core, "n", stream=False)  # nothing back yet
    _sent(core, "d")  # done: not sent again
    _sent(core, "x")  # abandoned: not sent again
    qid, _frame = core.query("stats")
    core.receive(_chunk("s", "He", [7, 8]))
    core.receive(_chunk("s", "llo", [9]))
    core.receive(cc.done_reply("d", "stop", None, cc.Usage(1, 1), cc.Timings(None, 0, 0, 0)))
    assert core.abandon("x") is not None
    _opened, abort = core.abort("s")  # an abort in flight: sent again after its request
    assert core.next_address() == "tcp://b:1"
    frames = core.resume_frames()
    ids = [rid for rid, _f in frames]
    assert sorted(ids[:3]) == sorted(["s", "n", qid]) and ids[3:] == ["s"]
    by_id = {rid: cc.decode_client_message(f) for rid, f in frames[:3] if rid != qid}
    resumed = by_id["s"]
    assert isinstance(resumed, cc.GenerateCommand)
    assert resumed.resume_token_ids == [7, 8, 9] and resumed.resume_text == "Hello"
    assert resumed.prompt == "hello" and resumed.sampling.max_tokens == 9
    plain = by_id["n"]
    assert isinstance(plain, cc.GenerateCommand) and plain.resume_token_ids is None
    assert frames[3][1] == abort
    assert resumed.sampling.seed is not None  # pinned when first sent: the same draws again


def test_a_request_resumed_too_often_fails() -> None:
    core = ClientCore("tcp://a:1", 5, 5)
    _sent(core, "s")
    for _ in range(DEFAULT_MAX_RESUMES):
        assert [rid for rid, _f in core.resume_frames()] == ["s"]
    assert core.resume_frames() == []
    with pytest.raises(EngineError) as info:
        core.stream_event(core.take("s", STREAM_KINDS) or {})
    assert info.value.code == "engine_unreachable"


def test_a_sampled_request_gets_a_seed_so_its_resumption_draws_alike() -> None:
    assert "seed" not in pin_seed({"temperature": 0.0})
    assert pin_seed({"seed": 3})["seed"] == 3
    seeded = pin_seed({"temperature": 0.7})["seed"]
    assert isinstance(seeded, int) and 0 <= seeded < 2**63
    core = ClientCore("tcp://a:1", 5, 5)
    _rid, frame = core.generate("r", "hi", None, None, True, 0, {})
    assert isinstance(msgpack.unpackb(frame)["params"]["seed"], int)


def test_a_resumed_request_the_new_frontend_is_not_ready_for_goes_again() -> None:
    """A restarted frontend answers `not_ready` until it heard its engines: within the resume
    window that answer is not the caller's; the request is sent again a moment later."""
    core = ClientCore("tcp://a:1", 5, 5)
    _sent(core, "s")
    core.receive(_chunk("s", "He", [7]))
    (frame,) = [f for _rid, f in core.resume_frames()]
    assert core.receive(cc.error_reply("not_ready", "waiting", "s")) is None  # held back
    assert core.take("s", STREAM_KINDS) is not None  # the chunk; not the refusal
    assert core.take("s", STREAM_KINDS) is None and core.open_requests.retrying()
    time.sleep(RETRY_S + 0.05)
    assert core.retry_frames() == [("s", frame)]
    assert not core.open_requests.retrying()
