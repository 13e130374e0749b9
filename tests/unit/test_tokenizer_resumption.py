"""Resumption in the frontend (services/tokenizer/resumption.py, docs/design/resumption.md): a
real FrontendServer turned by hand with raw schedulers and a raw client
(tests/support/frontend_stack.py), `check_invariants()` after every turn.

* one engine lost: its requests wait, then resume on it once it says ready again; waiting too
  long ends them `engine_unreachable`; resuming too often too;
* `drain`: the engine is told, the frontend's requests move at once (no fault), an unknown
  engine is refused;
* a client resuming a stream (`resume`): it goes on after the tokens the client has; one that
  is complete ends at once; a text that does not match is refused;
* a sampled request's seed is pinned at admission, so every attempt draws alike.
Rough runtime: 2-4 s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from services.tokenizer.engine_link import DRAINING
from shared.protocol.engine_channel import (
    DrainEngine,
    EngineNotReady,
    EngineShutdown,
    OutputBatch,
    RequestOutput,
    RequestRejected,
    SubmitRequest,
)
from shared.protocol.worker_channel import default_seed
from tests.support.frontend_stack import Stack, byte_codec, stacks


@pytest.fixture
def stack_of() -> Iterator[Callable[..., Stack]]:
    yield from stacks("cv-resume-")


def _submits(s: Stack, engine: int) -> list[SubmitRequest]:
    return [m for m in s.engines[engine].got if isinstance(m, SubmitRequest)]


def _lose(s: Stack, engine: int) -> None:
    s.engines[engine].ready = False
    s.engines[engine].send(EngineShutdown("test"))


def test_one_engine_lost_its_requests_wait_then_resume_on_it(
    stack_of: Callable[..., Stack],
) -> None:
    s = stack_of(num_engines=1)
    s.wait_all_ready()
    s.client.generate("a")
    s.pump(lambda: s.num_submitted() == 1, "a's submission")
    (rid,) = s.engines[0].submitted()
    s.engines[0].send(OutputBatch(1, [rid], [65]))
    s.pump(lambda: bool(s.client.of("a")), "a's first chunk")
    _lose(s, 0)
    s.client.send("stats", "st")
    s.pump(lambda: bool(s.client.of("st")), "the stats reply")
    assert s.client.of("st")[0]["frontend"]["requests_waiting_for_engine"] == 1.0
    s.engines[0].ready = True  # the restarted scheduler answers the next hello
    s.pump(lambda: len(s.engines[0].submitted()) == 2, "the resumption")
    resumed = _submits(s, 0)[-1]
    assert (resumed.rid, resumed.attempt, resumed.output_token_ids) == (f"{rid}.1", 1, [65])
    s.engines[0].send(OutputBatch(2, finished=[RequestOutput(resumed.rid, [66], "length")]))
    s.pump(lambda: s.client.of("a")[-1]["type"] == "done", "a's done")
    assert [t for r in s.client.of("a") for t in r.get("token_ids") or []] == [65, 66]


def test_waiting_too_long_or_resuming_too_often_is_engine_unreachable(
    stack_of: Callable[..., Stack],
) -> None:
    s = stack_of(resume_timeout_s=0.3, max_resumes=1)
    s.wait_all_ready()
    s.client.generate("a")  # engine 0 (round-robin)
    s.pump(lambda: s.num_submitted() == 1, "a's submission")
    _lose(s, 0)
    s.pump(lambda: len(s.engines[1].submitted()) == 1, "a moved to engine 1")
    (moved,) = s.engines[1].submitted()
    s.engines[1].send(RequestRejected(moved, "not_ready", "no worker"))  # a second fault
    s.pump(lambda: bool(s.client.of("a")), "a's end")
    assert [r["code"] for r in s.client.of("a")] == ["engine_unreachable"]
    s.client.generate("b")  # engine 1; then engine 1 is lost too: b waits, nobody takes it
    s.pump(lambda: len(s.engines[1].submitted()) == 2, "b's submission")
    _lose(s, 1)
    s.pump(lambda: bool(s.client.of("b")), "b's end after the resume time-out")
    assert [r["code"] for r in s.client.of("b")] == ["engine_unreachable"]
    assert "within 0.3 s" in s.client.of("b")[0]["message"]


def test_drain_moves_the_requests_off_the_engine(stack_of: Callable[..., Stack]) -> None:
    s = stack_of(max_resumes=0)  # a drain is no fault: it moves even with no resume left
    s.wait_all_ready()
    s.client.generate("a")  # engine 0
    s.pump(lambda: s.num_submitted() == 1, "a's submission")
    (rid,) = s.engines[0].submitted()
    s.engines[0].send(OutputBatch(1, [rid], [65]))
    s.pump(lambda: bool(s.client.of("a")), "a's first chunk")
    s.client.send("drain", "d", engine="0")
    s.pump(lambda: bool(s.client.of("d")) and bool(s.engines[1].submitted()), "the drain")
    assert s.client.of("d")[0] == {"type": "drain", "v": 1, "id": "d", "engine": "0",
                                   "draining": True, "num_moved": 1}  # fmt: skip
    assert any(isinstance(m, DrainEngine) and m.drain for m in s.engines[0].got)
    assert _submits(s, 1)[0].output_token_ids == [65]
    s.engines[0].send(EngineNotReady(DRAINING))  # what the scheduler then says to everyone
    s.client.send("health", "h")
    s.pump(lambda: bool(s.client.of("h")), "health")
    assert s.client.of("h")[0]["engines"][0]["reason"] == "draining"
    s.client.generate("b")  # goes to engine 1: engine 0 takes nothing
    s.pump(lambda: len(s.engines[1].submitted()) == 2, "b's submission")
    s.client.send("drain", "bad", engine="7")
    s.pump(lambda: bool(s.client.of("bad")), "the refusal")
    assert s.client.of("bad")[0]["code"] == "invalid_field"


def _generate(s: Stack, id: str, **fields: object) -> None:
    s.client.send("generate", id, prompt_token_ids=[70, 71, 72], stream=True, **fields)


def test_a_client_resumes_a_stream_after_the_tokens_it_has(
    stack_of: Callable[..., Stack],
) -> None:
    s = stack_of()
    s.wait_all_ready()
    text = byte_codec().decode([65, 66])
    _generate(s, "r", params={"max_tokens": 4, "temperature": 0},
              resume={"token_ids": [65, 66], "text": text})  # fmt: skip
    s.pump(lambda: s.num_submitted() == 1, "the submission")
    (sub,) = _submits(s, 0)
    assert sub.output_token_ids == [65, 66] and sub.attempt == 0
    s.engines[0].send(OutputBatch(1, [sub.rid], [67]))
    s.engines[0].send(OutputBatch(2, finished=[RequestOutput(sub.rid, [68], "length")]))
    s.pump(lambda: bool(s.client.of("r")) and s.client.of("r")[-1]["type"] == "done", "done")
    frames = s.client.of("r")
    assert [t for r in frames for t in r.get("token_ids") or []] == [67, 68]  # new ones only
    assert "".join(r.get("text") or "" for r in frames) == byte_codec().decode([67, 68])
    assert frames[-1]["usage"]["completion_tokens"] == 4


def test_a_resumed_stream_that_is_complete_ends_at_once(stack_of: Callable[..., Stack]) -> None:
    s = stack_of()
    s.wait_all_ready()
    ids = [65, 66]
    _generate(s, "full", params={"max_tokens": 2}, resume={"token_ids": ids, "text": ""})
    _generate(s, "bad", params={"max_tokens": 9}, resume={"token_ids": ids, "text": "zz"})
    s.pump(lambda: bool(s.client.of("full")) and bool(s.client.of("bad")), "both ends")
    full = s.client.of("full")
    assert [r["type"] for r in full] == ["chunk", "done"]  # the text the client lacked, done
    assert full[0]["text"] == byte_codec().decode(ids) and full[0]["token_ids"] == []
    assert full[-1]["finish_reason"] == "length"
    assert [r["code"] for r in s.client.of("bad")] == ["invalid_field"]
    assert s.num_submitted() == 0


def test_a_sampled_request_gets_its_seed_pinned(stack_of: Callable[..., Stack]) -> None:
    s = stack_of()
    s.wait_all_ready()
    _generate(s, "sampled", params={"max_tokens": 4})
    _generate(s, "seeded", params={"max_tokens": 4, "seed": 7})
    _generate(s, "greedy", params={"max_tokens": 4, "temperature": 0})
    s.pump(lambda: s.num_submitted() == 3, "three submissions")
    subs = sorted(_submits(s, 0) + _submits(s, 1), key=lambda m: int(m.rid.rsplit("-", 1)[1]))
    assert [m.sampling.seed for m in subs] == [default_seed(subs[0].rid), 7, None]
