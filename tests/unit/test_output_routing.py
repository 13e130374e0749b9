"""Routing one step's outputs to the frontends that own them (services/scheduler/
output_routing.py): tokens reach only their own frontend, finals once, orphans nowhere."""

from __future__ import annotations

from services.scheduler.output_routing import split_by_frontend
from shared.protocol.engine_channel import OutputBatch, RequestOutput
from shared.protocol.worker_channel import TokenLogprobs

LP = TokenLogprobs(-0.5, [3], [-0.5])


def test_one_frontend_gets_the_columns_whole() -> None:
    batch = OutputBatch(7, ["a", "b", "c"], [1, 2, 3], {"b": LP}, [RequestOutput("d", [4], "stop")])
    owners = {"a": b"fe1", "b": b"fe1", "c": b"fe1", "d": b"fe1"}
    done: list[str] = []
    parts = split_by_frontend(batch, owners, lambda out: done.append(out.rid))
    assert list(parts) == [b"fe1"]
    part = parts[b"fe1"]
    assert part.rids == ["a", "b", "c"] and part.token_ids == [1, 2, 3]
    assert part.logprobs == {"b": LP} and [o.rid for o in part.finished] == ["d"]
    assert done == ["d"] and "d" not in owners


def test_two_frontends_and_an_orphan() -> None:
    batch = OutputBatch(
        7, ["a", "x", "b", "c"], [1, 9, 2, 3], {"a": LP, "b": LP}, [RequestOutput("d", [], "abort")]
    )
    owners = {"a": b"fe1", "b": b"fe2", "c": b"fe1", "d": b"fe2"}  # "x": its frontend left
    parts = split_by_frontend(batch, owners, lambda out: None)
    assert parts[b"fe1"].rids == ["a", "c"] and parts[b"fe1"].token_ids == [1, 3]
    assert parts[b"fe1"].logprobs == {"a": LP} and parts[b"fe1"].finished == []
    assert parts[b"fe2"].rids == ["b"] and parts[b"fe2"].token_ids == [2]
    assert parts[b"fe2"].logprobs == {"b": LP} and [o.rid for o in parts[b"fe2"].finished] == ["d"]


def test_only_orphans_send_nothing() -> None:
    batch = OutputBatch(7, ["x", "y"], [1, 2])
    assert split_by_frontend(batch, {"a": b"fe1"}, lambda out: None) == {}
