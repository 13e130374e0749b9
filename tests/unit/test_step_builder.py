"""The step builder's cached shape (services/scheduler/step.py `final_shape`): it is what
`shape()` walks now, however the step was filled (the filler appends decodes to the list
itself, chunks come through `add_chunk`, preemption through `drop`)."""

from __future__ import annotations

from services.scheduler.request import Request
from services.scheduler.step import StepBuilder
from tests.support.scheduler_requests import make_request


def _req(rid: str, num_tokens: int, num_computed: int) -> Request:
    return make_request(rid, num_tokens, num_computed_tokens=num_computed)


def test_final_shape_follows_every_way_a_step_is_filled() -> None:
    step = StepBuilder(token_budget=512)
    a, b, c = _req("a", 40, 39), _req("b", 90, 89), _req("c", 300, 0)
    step.decodes.append(a)
    assert step.final_shape() == step.shape()
    step.decodes.append(b)  # the filler's hot loop: no method call
    assert step.final_shape() == step.shape()
    assert step.final_shape().num_rows == 2
    step.add_chunk(c, 128)
    assert step.final_shape() == step.shape()
    step.drop(a)
    assert step.final_shape() == step.shape()
    assert step.final_shape().num_rows == 2
    step.reuse_decodes([a, b], ["a", "b"], [])
    assert step.final_shape() == step.shape()
    assert step.final_shape().num_rows == 3
