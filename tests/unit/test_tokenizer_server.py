"""The frontend's parts keep their invariants through every way a request lives and ends
(services/tokenizer/server.py and the parts it wires): a real FrontendServer in this process,
turned one loop turn at a time over real sockets, with `check_invariants()` after every turn.

Its peers speak the wire protocols by hand (tests/support/frontend_stack.py): a DEALER client
(the client channel) and two raw schedulers, ROUTERs that answer each FrontendHello with
EngineReady and send what the test says (as tests/e2e/test_engine_routing.py drives the
scheduler with raw frontends). Rough runtime: 1-2 s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from shared.protocol.engine_channel import (
    EngineShutdown,
    FrontendBye,
    OutputBatch,
    RequestOutput,
    RequestRejected,
    StatsReply,
)
from tests.support.frontend_stack import RawClient, Stack, stacks


@pytest.fixture
def stack_of() -> Iterator[Callable[..., Stack]]:
    yield from stacks()


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


def test_engine_loss_resumes_every_request_elsewhere(stack_of: Callable[..., Stack]) -> None:
    """Engine 0 stops: a (one token streamed) and c (none) resume on engine 1 as their next
    attempt, with the tokens they have; the lost engine is told to abort both; its late
    output finds nothing; b's refusal for a reason of its own (overloaded) ends b."""
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
    s.pump(lambda: len(s.engines[1].submitted()) == 3, "the move")
    moved = {m.rid: m for m in s.engines[1].got if getattr(m, "attempt", 0) == 1}
    assert set(moved) == {f"{rid_a}.1", f"{rid_c}.1"}
    assert moved[f"{rid_a}.1"].output_token_ids == [65]  # what a has, apart from its prompt
    assert moved[f"{rid_c}.1"].output_token_ids == []
    assert moved[f"{rid_a}.1"].prompt_token_ids == [70, 71, 72]
    s.pump(lambda: len(s.engines[0].aborted()) == 2, "the aborts at the lost engine")
    assert s.engines[0].aborted() == {rid_a: "engine_lost", rid_c: "engine_lost"}
    s.engines[0].send(OutputBatch(2, [rid_c, rid_a], [99, 99]))  # late: dropped (fenced)
    s.engines[1].send(RequestRejected(rid_b, "overloaded", "full"))
    s.engines[1].send(OutputBatch(1, [f"{rid_a}.1"], [66]))
    s.engines[1].send(
        OutputBatch(
            2,
            finished=[
                RequestOutput(f"{rid_a}.1", [67], "length"),
                RequestOutput(f"{rid_c}.1", [66, 67], "length"),
            ],
        )
    )
    s.pump(lambda: all(s.client.of(n) for n in "bc") and len(s.client.of("a")) == 4, "the ends")
    assert [r["code"] for r in s.client.of("b")] == ["overloaded"]
    a_frames = s.client.of("a")
    assert [r["type"] for r in a_frames] == ["chunk", "chunk", "chunk", "done"]
    assert [t for r in a_frames[:3] for t in r["token_ids"]] == [65, 66, 67]  # once each
    assert a_frames[-1]["usage"]["completion_tokens"] == 3
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
    # its last frame may still be in flight when the server stops: the client keeps reading
    s.pump(lambda: s.server.stopped and bool(s.client.of("y")), "the drained stop")
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
