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

Readers restore the three lists with conveyor/bench/steplog.py `with_step_columns`, reading the
lines in file order.
"""

from __future__ import annotations

from typing import Optional

from services.scheduler.stats import StepRecord


class StepLogColumns:
    """Per process (the server's): remembers the last rid list written."""

    def __init__(self) -> None:
        self._rids: Optional[list[str]] = None
        self._rids_step: Optional[int] = None

    def fields(self, record: StepRecord) -> dict[str, object]:
        """The record's fields for its line, the per-request lists in the compact form."""
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
        return fields
