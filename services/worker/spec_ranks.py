"""Speculative decoding with tensor parallelism (docs/design/speculation.md, "Tensor
parallelism"): rank 0 proposes and verifies, as it samples; every rank computes the same query
tokens and ends the step with the same histories and computed counts (so the same KV).

Two broadcasts from rank 0 carry it (parallel.py's `broadcast_ints`; every rank knows their
sizes from the plan it applied, so no size travels first):

* **drafts**, after rank 0 proposed and before the forward, only in a step whose plan gives
  draft limits: per limited row (batch order) how many drafts, then each row's drafts padded
  to its limit. The other ranks add them to their histories (`HeldBatch.propose`) and compute
  them. A step without limits costs nothing more.
* **accepted counts** ride the broadcast of the sampled tokens: one more entry per drafting
  row (batch order). The other ranks drop the rejected drafts (`HeldBatch.settle`) before
  recording the tokens, as rank 0's verification does.

Why not the plan: the scheduler learns the accepted counts from rank 0's result only after the
step, and with `--async-scheduling` the next plan is built before that; a rank that waited for
them would hold drafts it has not settled while computing the next step. Why not a proposer
per rank: a draft model would then run on every rank (its unseeded draws from one generator),
and n-gram drafts agree only while every rank's index does; one proposer on rank 0 and a
broadcast of at most `rows x (1 + k)` ints keep one owner.
"""

from __future__ import annotations

from typing import Optional

from services.worker.held_batch import ExpandedStep, HeldBatch
from services.worker.parallel import Group
from shared.protocol.worker_channel import DraftOutcome


def share_drafts(group: Group, held: HeldBatch, step: ExpandedStep) -> None:
    """Every rank, after rank 0 proposed (`Speculator.propose`) and before the inputs are built:
    rank 0's drafts join the other ranks' histories, so every rank computes the same tokens.
    A no-op for a single rank and for a step whose plan gave no draft limits."""
    limits = step.draft_limits
    if group.world_size == 1 or not limits:
        return
    rows = sorted(limits)
    payload: Optional[list[int]] = None
    if group.rank == 0:
        drafts = step.drafts or {}
        payload = [len(drafts.get(b, [])) for b in rows]
        for b in rows:
            mine = drafts.get(b, [])
            payload += mine + [0] * (limits[b] - len(mine))  # padding: never read
    values = group.broadcast_ints(payload, len(rows) + sum(limits.values()))
    if group.rank == 0:
        return
    at = len(rows)
    for b, count in zip(rows, values[: len(rows)], strict=True):
        held.propose(step, b, values[at : at + count])
        at += limits[b]


def share_samples(
    group: Group,
    held: HeldBatch,
    step: ExpandedStep,
    token_ids: list[int],
    outcome: Optional[DraftOutcome],
    num_samplers: int,
) -> list[int]:
    """Every rank, after rank 0 sampled (and verified: `outcome`, rank 0's): the step's sampled
    tokens (`num_samplers` of them) on every rank; in a step with drafts the other ranks settle
    each drafting row at rank 0's accepted count first. One broadcast, as without drafts."""
    rows = sorted(step.drafts or {})  # drafting rows, the same on every rank (share_drafts)
    payload: Optional[list[int]] = None
    if group.rank == 0:
        payload = token_ids + _accepted(step, outcome, rows)
    values = group.broadcast_ints(payload, num_samplers + len(rows))
    if group.rank != 0:
        for b, accepted in zip(rows, values[num_samplers:], strict=True):
            held.settle(step, b, accepted)
    return values[:num_samplers]


def _accepted(step: ExpandedStep, outcome: Optional[DraftOutcome], rows: list[int]) -> list[int]:
    """Rank 0: the accepted count of each drafting row `rows` (batch indices), from the
    outcome's sampler indices."""
    if not rows:
        return []
    assert outcome is not None, "a step with drafts was verified without an outcome"
    samplers = [b for b, flag in enumerate(step.sample) if flag]
    by_row = {samplers[i]: n for i, n in zip(outcome.rows, outcome.accepted, strict=True)}
    return [by_row[b] for b in rows]
