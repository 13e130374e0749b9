"""A minimal in-process stand-in for the scheduler, for tests (and benchmarks) of the runner.

It keeps a free list of blocks (optionally shuffled, so block tables are not contiguous),
schedules every active sequence each step (a prefill chunk of at most `chunk_size` tokens, or one
decode token), and can preempt a sequence (free its blocks, recompute it later as a new
sequence). It is deliberately simple: the real scheduling policies live in services/scheduler.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from services.worker.plan_writer import PlanWriter
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import StepPlan, StepResult


class BlockAllocator:
    """A free list of block ids; `shuffle_seed` hands them out in a random order."""

    def __init__(self, num_blocks: int, shuffle_seed: Optional[int] = None) -> None:
        self.free = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise ValueError(f"out of KV blocks: need {n}, {len(self.free)} free")
        out, self.free = self.free[:n], self.free[n:]
        return out

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


@dataclass
class DriverSeq:
    rid: str
    token_ids: list[int]  # prompt + outputs
    num_prompt_tokens: int
    sampling: SamplingParams
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    sent: bool = False  # the worker knows it (else the next plan sends a NewSequence)

    @property
    def outputs(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.sampling.max_tokens


class PlanDriver:
    """Builds StepPlans for a set of sequences and feeds sampled tokens back."""

    def __init__(
        self,
        execute: Callable[[StepPlan], StepResult],
        num_blocks: int,
        block_size: int,
        chunk_size: int = 16,
        shuffle_seed: Optional[int] = None,
    ) -> None:
        self.execute = execute
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.blocks = BlockAllocator(num_blocks, shuffle_seed)
        self.seqs: dict[str, DriverSeq] = {}
        self.released: list[str] = []
        self.writer = PlanWriter()  # what the worker holds; plans carry only changes
        self.step_id = 0
        self.results: list[StepResult] = []

    def add(self, rid: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
        self.seqs[rid] = DriverSeq(rid, list(prompt_ids), len(prompt_ids), sampling)

    def preempt(self, rid: str) -> None:
        """Free the sequence's blocks; it is recomputed (prompt + outputs) from scratch."""
        seq = self.seqs[rid]
        self.blocks.give_back(seq.block_ids)
        if seq.sent:
            self.released.append(rid)
        seq.block_ids, seq.num_computed, seq.sent = [], 0, False

    def active(self) -> list[str]:
        return [rid for rid, s in self.seqs.items() if not s.done]

    def step(self, rids: Optional[list[str]] = None) -> StepResult:
        """Schedule `rids` (default: every unfinished sequence), execute, record tokens."""
        chosen = [self.seqs[r] for r in (rids if rids is not None else self.active())]
        new_seqs, scheduled, appended = [], {}, {}
        for seq in chosen:
            n = min(self.chunk_size, len(seq.token_ids) - seq.num_computed)
            need = -(-(seq.num_computed + n) // self.block_size) - len(seq.block_ids)
            added = self.blocks.take(max(need, 0))
            seq.block_ids.extend(added)
            if not seq.sent:
                new_seqs.append(
                    self.writer.new_sequence(
                        seq.rid,
                        seq.token_ids,
                        seq.num_prompt_tokens,
                        seq.block_ids,
                        seq.sampling,
                        seq.num_computed,
                    )  # fmt: skip
                )
            elif added:
                appended[seq.rid] = added
            scheduled[seq.rid] = n
        plan = self.writer.plan(scheduled, new_seqs, appended, self.released)
        self.step_id = self.writer.next_step_id
        self.released = []
        sampling = {s.rid for s in chosen if s.num_computed + scheduled[s.rid] == len(s.token_ids)}
        result = self.execute(plan)
        for seq in chosen:
            seq.num_computed += scheduled[seq.rid]
            seq.sent = True
        for rid, tok in self.writer.samplers(plan, result.token_ids, sampling).items():
            self.seqs[rid].token_ids.append(tok)
        for seq in chosen:
            if seq.done:
                self.blocks.give_back(seq.block_ids)
                seq.block_ids = []
                self.released.append(seq.rid)
        self.results.append(result)
        return result

    def run(self, max_steps: int = 100_000) -> dict[str, list[int]]:
        """Step until every sequence has max_tokens outputs; returns rid -> output ids."""
        for _ in range(max_steps):
            if not self.active():
                break
            self.step()
        return {rid: s.outputs for rid, s in self.seqs.items()}
