"""Grammar masks for constrained rows that verify drafts (speculative decoding; the design:
docs/design/speculation.md, "Masks").

A constrained sequence verifying drafts x_1..x_d has d + 1 rows of the step's logits; row j
samples output index n + j after x_1..x_j, so its mask is the one its matcher gives after
consuming x_1..x_j: exactly the mask a plain decode at that index would get from the same
history. llguidance computes all d + 1 masks in one call without the GIL (its executor's
`unsafe_compute_mask_ptr_with_draft_token`, the helper thread's job, beside the forward as for
plain rows): it advances a copy of the state through the drafts and rolls it back, so the
matcher stays at the sequence's confirmed outputs, and the next job catches it up with what
was accepted (the history then holds the accepted drafts and the target's token after them).

Rows the library leaves unwritten keep the all-allowed mask:
* after a draft the grammar refuses: that draft's bit is 0 in the row before, so no target
  token equals it, verification rejects it and every draft after it, and those rows are
  never emitted (all-allowed keeps their softmax finite);
* after an end-of-sequence draft (the grammar completed and stopped): a stopped matcher allows
  only end-of-sequence, so the job writes that into the `rows_after_eos`, as a plain decode
  would see it (it matters only to a request that ignores EOS).
"""

from __future__ import annotations

from collections.abc import Sequence


def first_logits_rows(num_drafts: Sequence[int]) -> list[int]:
    """Each sampler's first row of the step's logits: one row per sampler plus one per draft,
    in batch order (speculate.draft_logits_rows)."""
    out, at = [], 0
    for d in num_drafts:
        out.append(at)
        at += 1 + d
    return out


def rows_after_eos(first: int, drafts: Sequence[int], eos_token_ids: Sequence[int]) -> range:
    """The rows `first + j` (j = 1..d) that follow an end-of-sequence draft among x_1..x_j:
    they allow only end-of-sequence (what the stopped matcher allows)."""
    eos = set(eos_token_ids)
    for j, x in enumerate(drafts):
        if x in eos:
            return range(first + j + 1, first + len(drafts) + 1)
    return range(0)
