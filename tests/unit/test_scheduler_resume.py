"""A resumption in the scheduler core (docs/design/resumption.md): a SubmitRequest carrying the
outputs of an earlier attempt continues after them exactly as the undisturbed request would
have: the worker sees them as outputs (the output index of the next sample, penalties),
`max_tokens` counts them, the stop tokens apply to what follows; one that has its
`max_tokens` already is refused. Checked with the checking worker (tokens depend only on the
rid and the output index) and `check_invariants()` after every step."""

from __future__ import annotations

import dataclasses

from test_scheduler_support import drive, make, submit

from shared.protocol.errors import ErrorCode


def test_a_resumed_request_goes_on_after_the_outputs_it_carries() -> None:
    sched, worker, clock = make(enable_prefix_caching=False)
    assert sched.add_request(submit("r", 7, 6)) is None
    whole = drive(sched, worker, clock).tokens("r")
    assert len(whole) == 6
    sched2, worker2, clock2 = make(enable_prefix_caching=False)
    resumed = dataclasses.replace(submit("r", 7, 6), output_token_ids=whole[:4], attempt=1)
    assert sched2.add_request(resumed) is None
    run = drive(sched2, worker2, clock2)
    assert run.tokens("r") == whole[4:]  # 2 more: max_tokens counts the carried ones
    (new,) = [s for s in run.plans[0].new_seqs if s.rid == "r"]
    assert new.num_prompt_tokens == 7 and new.token_ids[7:11] == whole[:4]
    final = run.outputs["r"][-1]
    assert final.finish_reason == "length" and final.num_output_tokens == 6
    assert sched2.stats()["num_resumptions_admitted"] == 1


def test_a_resumption_that_has_its_max_tokens_already_is_refused() -> None:
    sched, _, _ = make()
    full = dataclasses.replace(submit("r", 4, 3), output_token_ids=[5, 6, 7], attempt=1)
    rejected = sched.add_request(full)
    assert rejected is not None and rejected.code == ErrorCode.INVALID_PARAMS
