"""The step log's line: one JSON line per completed step (event "step", written by the server
once the next plan has left), its per-request columns in a compact form.

A step record (services/scheduler/stats.py `StepRecord`) names every request that computed, in
batch order, with its token count and whether it was a prefill chunk; at hundreds of running
requests those three lists are most of the line (27 KB at 1,024) and of the work of writing it,
every step. The line keeps what they say, compactly:

* `rids`: written when the list differs from the previous step line's; otherwise
  `rids_as_step` names the step line that wrote it (a steady batch writes it once);
* `num_decodes` and `chunk_num_tokens`: a step computes its decodes (one token each) first, then
  its prefill chunks, so `num_tokens` is `num_decodes` ones followed by `chunk_num_tokens`, and
  `is_prefill` is false for the decodes and true for the chunks.

* speculation, on a step whose plan gave draft limits (absent otherwise, so a plain line is as
  before): `draft_limit` (the drafts the plan allowed, summed), and from its result
  `num_draft_rows` (decodes that proposed), `num_draft_tokens` (proposed) and
  `num_accepted_tokens` (accepted by the target): the step's acceptance.

Readers restore the three lists with conveyor/bench/steplog.py `with_step_columns`, reading the
lines in file order.
"""

from __future__ import annotations

from typing import Optional

from services.scheduler.stats import StepRecord
from shared.protocol.worker_channel import StepPlan, StepResult


class StepLogColumns:
    """Per process (the server's): remembers the last rid list written."""

    def __init__(self) -> None:
        self._rids: Optional[list[str]] = None
        self._rids_step: Optional[int] = None

    def fields(
        self,
        record: StepRecord,
        plan: Optional[StepPlan] = None,
        result: Optional[StepResult] = None,
    ) -> dict[str, object]:
        """The record's fields for its line, the per-request lists in the compact form; with
        the step's plan and result, its drafts (`draft_fields`)."""
        fields = record.to_dict()
        del fields["num_tokens"], fields["is_prefill"]
        rids = record.rids
        if rids == self._rids:  # the common case: the same batch (compared in C)
            del fields["rids"]
            fields["rids_as_step"] = self._rids_step
        else:
            self._rids, self._rids_step = rids, record.step_id
        num_decodes = record.is_prefill.count(False)  # decodes come first (step.py)
        fields["num_decodes"] = num_decodes
        fields["chunk_num_tokens"] = record.num_tokens[num_decodes:]
        if plan is not None and result is not None:
            fields.update(draft_fields(plan, result))
        return fields


def draft_fields(plan: StepPlan, result: StepResult) -> dict[str, int]:
    """A step's speculation columns: empty unless its plan gave draft limits."""
    if plan.drafts is None or not plan.drafts.limits:
        return {}
    outcome = result.drafts
    return {
        "draft_limit": sum(plan.drafts.limits),
        "num_draft_rows": len(outcome.rows) if outcome else 0,
        "num_draft_tokens": sum(outcome.proposed) if outcome else 0,
        "num_accepted_tokens": sum(outcome.accepted) if outcome else 0,
    }
