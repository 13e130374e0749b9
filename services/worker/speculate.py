"""Speculative decoding, the worker's side (docs/design/speculation.md): proposing drafts for the
decodes a plan gave a limit, and verifying them against the target's own samples.

* `NgramProposer` (`--speculative ngram`): prompt lookup. Per held sequence an index from each
  n-gram of its history to where it last ended; the drafts are the tokens that followed the
  most recent earlier occurrence of the history's last `n` tokens. The index grows with the
  history (O(1) per appended token); drafts are never indexed (rejected ones leave the history
  before the next proposal, accepted ones are indexed as outputs then).
* `Speculator.verify`: each drafting sequence's `d + 1` logits rows are sampled exactly as plain
  decodes at output indices `n .. n + d` would be (the same row-wise sampler, the same draw
  u(seed, n + j), penalties over the history up to that row). A draft is accepted while it
  equals the target's token for its index; the target's token after the accepted ones is the
  row's sample. Every emitted token is the one the target samples at that index from the same
  history: the text equals the text without speculation, greedy or seeded; for n-gram drafts
  (a point mass) this is rejection sampling's accept-with-p(x), residual p without x.

Each row is sampled once: the rows rejection sampling draws are left out of the plain sampler.
The logprobs of accepted drafts are those of the target's token at each draft's own row (the
distribution a plain decode at that index would have used).

* The draft model (`--speculative draft`, services/worker/draft_model.py) is the other proposer
  behind the same seam (`Proposer`). Its drafts for a sampled request without a client seed
  come with the distribution q they were drawn from, and are verified by rejection sampling
  (draft_rejection.py) instead: the target's distribution is kept, not its seeded text.

* Constrained rows (structured outputs) draft too: the mask job (constraints.py, on the helper
  thread beside the forward) gives each of their d + 1 verified rows the mask of the matcher
  advanced through the drafts before it, and keeps the matcher at the confirmed outputs
  (spec_masks.py); `verify` applies the masks before any row is read, so a draft the grammar
  refuses is never accepted.

With tensor parallelism rank 0 proposes and verifies; spec_ranks.py hands its drafts and
accepted counts to the other ranks. Not yet (designed): pipelined steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional, Protocol, cast

import torch

from services.worker.config import WorkerConfig
from services.worker.constraints import RowMasks
from services.worker.draft_rejection import Drafts, rejection_sample
from services.worker.held_batch import ExpandedStep, HeldBatch, HeldSeq
from services.worker.sampler import (
    SampleRow,
    apply_token_masks,
    processed_logits,
    sample,
    token_logprobs,
)
from shared.protocol.worker_channel import DraftOutcome, TokenLogprobs

VERIFY_SEED = 0  # the rejection sampler's generator (requests without a seed), seeded at start


class Proposer(Protocol):
    """What proposes drafts: NgramProposer, draft_model.DraftModel."""

    def propose_rows(self, seqs: list[HeldSeq], limits: list[int]) -> list[Drafts]:
        """Up to `limits[i]` drafts for each decode `seqs[i]` (its history ends with the token
        this step decodes); called once per step with drafts, after the plan is applied."""
        ...

    def forget(self, seqs: list[HeldSeq]) -> None:
        """Called with the sequences a plan released."""
        ...


class NgramProposer:
    """Prompt-lookup drafts from a sequence's own history (`n`: the length of the match)."""

    def __init__(self, n: int) -> None:
        self.n = n
        # slot -> (the sequence it indexes, n-gram -> end of its latest occurrence, tokens
        # of the history indexed so far)
        self._indexes: dict[int, tuple[HeldSeq, dict[tuple[int, ...], int], int]] = {}

    def propose(self, seq: HeldSeq, limit: int) -> list[int]:
        """Up to `limit` drafts for `seq` (its history ends with the token this step decodes),
        [] when its last `n` tokens occurred nowhere earlier."""
        tokens, n = seq.token_ids, self.n
        if len(tokens) <= n:
            return []
        index = self._index(seq)
        end = index.get(tuple(tokens[-n:]))
        return [] if end is None else tokens[end : end + limit]

    def propose_rows(self, seqs: list[HeldSeq], limits: list[int]) -> list[Drafts]:
        """`propose` per row (a point mass: no q)."""
        return [Drafts(self.propose(s, n)) for s, n in zip(seqs, limits, strict=True)]

    def forget(self, seqs: list[HeldSeq]) -> None:
        """Called with the sequences a plan released."""
        for seq in seqs:
            entry = self._indexes.get(seq.slot)
            if entry is not None and entry[0] is seq:
                del self._indexes[seq.slot]

    def _index(self, seq: HeldSeq) -> dict[tuple[int, ...], int]:
        """`seq`'s index brought up to its history less the last token: every n-gram that
        ends before it maps to where it ended (the latest occurrence wins)."""
        entry = self._indexes.get(seq.slot)
        if entry is None or entry[0] is not seq:
            entry = (seq, {}, 0)
        _, index, done = entry
        tokens, n = seq.token_ids, self.n
        for end in range(max(done, n), len(tokens)):  # n-grams tokens[end - n : end]
            index[tuple(tokens[end - n : end])] = end
        self._indexes[seq.slot] = (seq, index, len(tokens))
        return index


def make_speculator(
    config: WorkerConfig, rank: int, pipelined: bool, draft: Callable[[], Proposer]
) -> Optional[Speculator]:
    """The worker's speculator for `config.speculative` (None: off, or a tensor-parallel rank
    other than 0, which takes rank 0's drafts and accepted counts: spec_ranks.py); `draft`
    loads the draft model (called for "draft" on rank 0 only). ValueError where it does not
    run yet: pipelined steps (a CUDA device: --pipeline-steps off)."""
    if config.speculative == "off":
        return None
    if pipelined:
        raise ValueError(
            "speculative decoding does not run with pipelined steps yet (on CUDA: "
            "--pipeline-steps off)"
        )
    if rank > 0:
        return None
    return Speculator(draft() if config.speculative == "draft" else NgramProposer(config.ngram_n))


class Speculator:
    """Proposes and verifies for a worker's rank 0 (the only one that samples)."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.generator = torch.Generator().manual_seed(VERIFY_SEED)
        self._probs: dict[int, torch.Tensor] = {}  # b -> q [d, V] of this step's free rows

    def propose(self, held: HeldBatch, step: ExpandedStep) -> None:
        """Called after the plan is applied, before the inputs are built: each decode with a
        draft limit gets its drafts (constrained ones too: their grammar masks every verified
        row, spec_masks.py)."""
        self.proposer.forget(step.released)
        self._probs = {}
        limits = step.draft_limits or {}
        rows = [b for b, n in limits.items() if n > 0]
        if not rows:
            return
        proposals = self.proposer.propose_rows([step.seqs[b] for b in rows],
                                               [limits[b] for b in rows])  # fmt: skip
        for b, drafts in zip(rows, proposals, strict=True):
            held.propose(step, b, drafts.token_ids)
            if drafts.probs is not None and drafts.token_ids:
                self._probs[b] = drafts.probs

    def verify(
        self, held: HeldBatch, step: ExpandedStep, logits: torch.Tensor, masks: Optional[RowMasks]
    ) -> tuple[list[int], list[Optional[TokenLogprobs]], Optional[DraftOutcome]]:
        """`logits` [sum over samplers of 1 + drafts, V] (rows in `draft_logits_rows` order;
        `masks` name rows of it: one per verified row of a constrained sampler): the sampled
        token per sampler, their logprobs, and what was accepted. Settles every drafting
        sequence's history (held.settle); the caller records the tokens."""
        sampled = [b for b, flag in enumerate(step.sample) if flag]
        drafts = step.drafts or {}
        rows: list[SampleRow] = []
        starts: dict[int, int] = {}  # b -> its first logits row
        for b in sampled:
            starts[b] = len(rows)
            rows.extend(_rows_of(step.seqs[b], drafts.get(b, [])))
        if masks is not None:  # before anything reads the logits, the free rows too
            apply_token_masks(logits, masks)
        free = {b: self._reject(logits, rows, starts[b], drafts[b], q)
                for b, q in self._probs.items()}  # fmt: skip
        drawn = {r for b in free for r in range(starts[b], starts[b] + len(drafts[b]) + 1)}
        targets, logprobs = _sample_rest(logits, rows, drawn)
        tokens: list[int] = []
        kept: list[Optional[TokenLogprobs]] = []
        asking = {b for b in drafts if step.seqs[b].sampling.logprobs is not None}
        outcome = DraftOutcome(logprobs=[] if asking else None)
        for i, b in enumerate(sampled):
            proposed, at = drafts.get(b, []), starts[b]
            # rejection sampling (free rows): its own tokens; else the drafts equal to targets
            if b in free:
                accepted, mine, lps = free[b]
            else:
                mine = cast(list[int], targets[at : at + len(proposed) + 1])
                lps = logprobs[at : at + len(proposed) + 1]
                accepted = _matched(proposed, mine)
            if proposed:
                held.settle(step, b, accepted)
                outcome.rows.append(i)
                outcome.proposed.append(len(proposed))
                outcome.accepted.append(accepted)
                outcome.token_ids.extend(proposed[:accepted])
                if outcome.logprobs is not None and b in asking:  # each accepted row's own
                    outcome.logprobs.extend(_asked(lps[:accepted]))
            tokens.append(mine[accepted])
            kept.append(lps[accepted])
        return tokens, kept, outcome if outcome.rows else None

    def _reject(
        self, logits: torch.Tensor, rows: list[SampleRow], at: int, proposed: list[int],
        q: torch.Tensor,
    ) -> tuple[int, list[int], list[Optional[TokenLogprobs]]]:  # fmt: skip
        """Rejection sampling of one free row's drafts against q: (accepted, the tokens it
        emits at rows 0..accepted, their logprobs)."""
        mine = rows[at : at + len(proposed) + 1]
        x = processed_logits(logits[at : at + len(proposed) + 1], mine)  # [d + 1, V]
        p = torch.softmax(x, dim=1)
        accepted, token = rejection_sample(p, q.to(p.dtype), proposed, self.generator)
        emitted = proposed[:accepted] + [token]
        return accepted, emitted, token_logprobs(x, mine[: accepted + 1], emitted)


def sample_step(
    speculator: Optional[Speculator],
    held: HeldBatch,
    step: ExpandedStep,
    logits: torch.Tensor,
    rows: list[SampleRow],
    masks: Optional[RowMasks],
) -> tuple[list[int], list[Optional[TokenLogprobs]], Optional[DraftOutcome]]:
    """The runner's sampling on rank 0: `verify` for a step with drafts, else the plain
    sampler over one row per sampler."""
    if step.drafts and speculator is not None:
        return speculator.verify(held, step, logits, masks)
    token_ids, logprobs = sample(logits, rows, masks)
    return token_ids, logprobs, None


def sample_rows(sampled: list[HeldSeq]) -> list[SampleRow]:
    """One row per sampler, each at its next output index (a step without drafts)."""
    return [
        SampleRow(
            params=s.sampling,
            seed=s.seed,
            output_index=s.num_output_tokens,
            token_ids=s.token_ids,
            num_prompt_tokens=s.num_prompt_tokens,
        )
        for s in sampled
    ]


def draft_logits_rows(step: ExpandedStep, query_start_loc: list[int]) -> list[int]:
    """The flat token rows whose logits a step with drafts needs: for each sampler, its last
    `1 + drafts` rows (the decode token and each draft), in batch order."""
    drafts = step.drafts or {}
    out: list[int] = []
    for b, flag in enumerate(step.sample):
        if flag:
            end = query_start_loc[b + 1]
            out.extend(range(end - 1 - len(drafts.get(b, [])), end))
    return out


def _sample_rest(
    logits: torch.Tensor, rows: list[SampleRow], drawn: set[int]
) -> tuple[list[Optional[int]], list[Optional[TokenLogprobs]]]:
    """`sample` over every row but those rejection sampling drew already (each row is
    sampled once); None at those."""
    if not drawn:
        tokens, logprobs = sample(logits, rows)
        return cast(list[Optional[int]], tokens), logprobs
    keep = [r for r in range(len(rows)) if r not in drawn]
    out: list[Optional[int]] = [None] * len(rows)
    lps: list[Optional[TokenLogprobs]] = [None] * len(rows)
    if keep:
        tokens, logprobs = sample(logits[keep], [rows[r] for r in keep])
        for r, t, lp in zip(keep, tokens, logprobs, strict=True):
            out[r], lps[r] = t, lp
    return out, lps


def _matched(proposed: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the target's own tokens at their rows."""
    accepted = 0
    while accepted < len(proposed) and proposed[accepted] == targets[accepted]:
        accepted += 1
    return accepted


def _asked(logprobs: list[Optional[TokenLogprobs]]) -> list[TokenLogprobs]:
    """The logprobs of rows whose request asked for them (the sampler gave each one)."""
    out = [lp for lp in logprobs if lp is not None]
    assert len(out) == len(logprobs)
    return out


def _rows_of(seq: HeldSeq, drafts: list[int]) -> list[SampleRow]:
    """A sampler's rows: row j samples output index n + j after the first j drafts."""
    d = len(drafts)
    first = seq.num_output_tokens - d  # n: its outputs before this step's drafts
    history = seq.token_ids
    return [
        SampleRow(
            params=seq.sampling,
            seed=seq.seed,
            output_index=first + j,
            token_ids=history if j == d else history[: len(history) - d + j],
            num_prompt_tokens=seq.num_prompt_tokens,
        )
        for j in range(d + 1)
    ]


def sampler_drafts(step: ExpandedStep) -> Optional[list[int]]:
    """How many drafts each sampler of `step` verifies (batch order), None when none drafts:
    the mask job's row layout (constraints.py `start`)."""
    if not step.drafts:
        return None
    return [len(step.drafts.get(b, [])) for b, flag in enumerate(step.sample) if flag]
