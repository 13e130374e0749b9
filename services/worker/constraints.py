"""Structured outputs in the worker: a grammar matcher per constrained sequence, and each step's
token masks, computed on a helper thread while the step's forward runs.

Where the masks come from (docs/design/step_contract.md, "Constrained sampling"): the worker
samples, so it owns the matchers (rank 0 only: the other ranks of a tensor-parallel group take
rank 0's tokens). For step N, `start` hands the mask job to the helper thread right before the
forward; the job brings each constrained sequence's matcher up to its history (its own samples
so far: the worker holds them, so with async scheduling nothing waits for the scheduler), then
fills the sequence's row of the bitmask. llguidance releases the GIL while it fills, so the job
runs beside the forward (torch releases it too); `wait` joins it after the forward and measures
how long sampling waited (`mask_wait_s`).

A sequence new to the worker (first scheduled, resumed after preemption, or replayed on a
restarted worker) gets its matcher compiled from the worker's own cache (shared/constraints.py)
on that thread too, then advanced through the outputs it already has: recompute rebuilds the
matcher from the token history, never from state the worker lost. Only the job changes the
matchers, and one job runs at a time, so no lock is needed.

Speculative decoding: a constrained sequence verifying d drafts has d + 1 rows of the step's
logits; the job fills each with the mask after the drafts before it, in the same GIL-free call,
and the matcher never keeps a draft (services/worker/spec_masks.py). The masks' rows are rows of
the step's logits.

A matcher that has stopped (the grammar is complete) allows only the end-of-sequence tokens, so
the request finishes there; one that failed (a token it cannot take, e.g. after a stop token
ended the request one step early under async scheduling) does the same.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import llguidance.torch as llg_torch
import torch
from llguidance import LLExecutor, LLMatcher

from services.worker.held_batch import PENDING_TOKEN, HeldSeq
from services.worker.spec_masks import first_logits_rows, rows_after_eos
from shared.constraints import GrammarCache, load_tokenizer

MAX_WAIT_SAMPLES = 4096  # mask waits kept for the bench (the most recent)


class TokenMatcher(Protocol):
    """What a sampler needs of one sequence's grammar state."""

    @property
    def num_tokens(self) -> int:
        """Tokens consumed since the start of the output."""
        ...

    def advance(self, token_id: int) -> bool:
        """Consume one sampled token; False when the grammar cannot take it (the matcher then
        allows only end-of-sequence)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` consumed (at most `num_tokens`)."""
        ...

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 [*, ceil(V / 32)], CPU,
        bit t % 32 of word t // 32 set when token t is allowed)."""
        ...


class LlgMatcher:
    """TokenMatcher over an llguidance matcher."""

    def __init__(self, matcher: LLMatcher, eos_token_ids: Sequence[int]) -> None:
        self._m = matcher
        self._eos = list(eos_token_ids)
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def llg(self) -> LLMatcher:
        """The llguidance matcher (the batch fill hands it to the library's executor)."""
        return self._m

    def failed(self) -> bool:
        return bool(self._m.is_error())

    def advance(self, token_id: int) -> bool:
        self._num_tokens += 1
        return bool(self._m.consume_token(token_id))

    def advance_all(self, token_ids: list[int]) -> bool:
        """Consume several tokens in one call (a sequence catching up with its history)."""
        self._num_tokens += len(token_ids)
        return bool(self._m.consume_tokens(token_ids))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > self._num_tokens or not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} of {self._num_tokens} tokens")
        self._num_tokens -= num_tokens

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_error():
            eos_only(bitmask, row, self._eos)
        else:
            llg_torch.fill_next_token_bitmask(self._m, bitmask, row)


def eos_only(bitmask: torch.Tensor, row: int, eos_token_ids: Sequence[int]) -> None:
    bitmask[row].zero_()
    for t in eos_token_ids:
        bitmask[row, t // 32] |= 1 << (t % 32)


@dataclass(frozen=True, slots=True)
class RowMasks:
    """The step's masks: `bitmask[j]` is for the sampled row `rows[j]`."""

    rows: list[int]  # [R] rows of the step's logits (one per sampler; more with drafts)
    bitmask: torch.Tensor  # [R, ceil(V / 32)] int32, CPU


@dataclass(slots=True)
class PendingMasks:
    future: Future[RowMasks]


class ConstraintMasks:
    """The matchers of one worker (rank 0) and the thread that computes each step's masks."""

    def __init__(self, folder: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._folder = folder
        self._cache: GrammarCache | None = None  # made by the first job (~0.3 s, off the step)
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._matchers: dict[HeldSeq, LlgMatcher] = {}  # changed only by the job
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="masks")
        # one thread: the forward's own threads have the other cores
        self._executor = LLExecutor(num_threads=1)
        self.mask_wait_s: deque[float] = deque(maxlen=MAX_WAIT_SAMPLES)
        self.num_steps = 0

    def start(
        self,
        sampled: Sequence[HeldSeq],
        held: Iterable[HeldSeq],
        num_drafts: Sequence[int] | None = None,
    ) -> PendingMasks | None:
        """Called before a step's forward with its sampled sequences (batch order) and every
        sequence the batch holds; None when no sampled sequence is constrained. `num_drafts`
        (speculative decoding): the drafts each sampled sequence verifies this step, the last
        tokens of its history; its rows of the step's logits are 1 + that many, each masked as
        a plain decode after the drafts before it (spec_masks.py). The masks' rows are rows
        of the step's logits."""
        rows = [i for i, seq in enumerate(sampled) if seq.sampling.constraint is not None]
        if not rows:
            return None
        drafts = list(num_drafts) if num_drafts else [0] * len(sampled)
        firsts = first_logits_rows(drafts)
        seqs = [(sampled[i], firsts[i], drafts[i]) for i in rows]
        return PendingMasks(self._thread.submit(self._job, seqs, list(held)))

    def wait(self, pending: PendingMasks) -> RowMasks:
        """Called after the forward: the masks (raises what the job raised)."""
        begin = time.perf_counter()
        masks = pending.future.result()
        self.mask_wait_s.append(time.perf_counter() - begin)
        self.num_steps += 1
        return masks

    def masks_now(self, sampled: Sequence[HeldSeq], held: Iterable[HeldSeq]) -> RowMasks | None:
        """The masks computed on the calling thread (pipelined steps: the device runs the
        forward meanwhile); histories must hold every token by now."""
        pending = self.start(sampled, held)
        return None if pending is None else self.wait(pending)

    def matcher(self, seq: HeldSeq) -> LlgMatcher | None:
        """A sequence's matcher, when a job made one (tests)."""
        return self._matchers.get(seq)

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def _job(self, seqs: list[tuple[HeldSeq, int, int]], held: list[HeldSeq]) -> RowMasks:
        """On the helper thread; `seqs`: (sequence, its first logits row, its drafts). Little
        Python and one call (two with drafts) that fills every row without the GIL: the
        forward's thread needs the GIL back after each of its operations, and a job that held
        it would stall the forward (measured on the tiny model: 40x slower steps)."""
        live = set(held)
        for gone in [s for s in self._matchers if s not in live]:
            del self._matchers[gone]
        num_rows = sum(1 + d for _, _, d in seqs)
        bitmask = torch.full((num_rows, (self._vocab_size + 31) // 32), -1, dtype=torch.int32)
        rows: list[int] = []  # the logits row of each bitmask row
        work: list[tuple[LLMatcher, int, list[int]]] = []  # matcher, its first row, drafts
        for seq, first, d in seqs:
            m, at = self._synced(seq, d), len(rows)
            rows.extend(range(first, first + d + 1))
            if m.failed():
                for row in range(at, at + d + 1):
                    eos_only(bitmask, row, self._eos)
            else:
                work.append((m.llg, at, seq.token_ids[len(seq.token_ids) - d :] if d else []))
        ptr, size = bitmask.data_ptr(), bitmask.shape[1] * 4
        if plain := [(m, at) for m, at, drafts in work if not drafts]:
            self._executor.unsafe_compute_mask_ptr(plain, ptr, size, num_rows)
        if drafting := [w for w in work if w[2]]:  # masks after each draft (spec_masks.py)
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafting, ptr, size, num_rows)
            for _, at, drafts in drafting:
                for row in rows_after_eos(at, drafts, self._eos):
                    eos_only(bitmask, row, self._eos)
        return RowMasks(rows, bitmask)

    def _synced(self, seq: HeldSeq, num_drafts: int) -> LlgMatcher:
        """The sequence's matcher, made if new, having consumed every output token it holds
        but its last `num_drafts` (this step's drafts; the matcher never keeps a draft)."""
        m = self._matchers.get(seq)
        if m is None:
            assert seq.sampling.constraint is not None
            if self._cache is None:
                tokenizer = load_tokenizer(self._folder, self._vocab_size, self._eos)
                self._cache = GrammarCache(tokenizer)
            m = LlgMatcher(self._cache.matcher(seq.sampling.constraint), self._eos)
            self._matchers[seq] = m
        end = len(seq.token_ids) - num_drafts
        outputs = seq.token_ids[seq.num_prompt_tokens + m.num_tokens : end]
        if PENDING_TOKEN in outputs:
            raise RuntimeError(f"{seq.rid!r}: a mask was asked before its last token landed")
        if outputs:
            m.advance_all(outputs)
        return m
