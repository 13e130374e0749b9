"""Time a worker's steps across shapes: the data `calibrate.py` fits a profile to.

Drives any runner with `ready_message(rank)` and `execute(plan)` (the real
`services.worker.runner.ModelRunner`, which `conveyor sim measure` passes in, or a SimRunner in
tests) with plans built the way the scheduler builds them: prompts prefilled first, then decode
steps over the same sequences; the block tables are real and every sequence is released at the
end. Each shape gets one untimed warm-up step. The output is the `samples` list of a
`conveyor-sim-timings/1` file.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from services.worker.plan_writer import PlanWriter
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import NewSequence

PROMPT_TOKEN_RANGE = (256, 32000)  # ordinary tokens: what real prompts are made of
MAX_PREFILL_TOKENS = 4096  # per untimed set-up step


@dataclass(frozen=True, slots=True)
class MeasureGrid:
    """Which shapes to time. Decodes: every batch size at every context; prefills: every
    length alone and `prefill_batch` at once; mixed: (decodes, prompt chunk) beside each other."""

    flag_env: ClassVar[bool] = False  # `conveyor sim measure` flags, no CONVEYOR_* variables

    batch_sizes: tuple[int, ...] = field(
        default=(1, 2, 4, 8, 16, 32), metadata={"help": "sequences of the decode samples"}
    )
    context_lens: tuple[int, ...] = field(
        default=(128, 512), metadata={"help": "cached tokens per sequence for the decode samples"}
    )
    prefill_lens: tuple[int, ...] = field(
        default=(16, 64, 128, 256, 512), metadata={"help": "prompt lengths of the prefill samples"}
    )
    prefill_batch: int = field(
        default=4, metadata={"help": "also time prefills of this many prompts at once"}
    )
    mixed: tuple[tuple[int, int], ...] = field(
        default=((8, 128), (16, 256)),
        metadata={"help": "DECODES:CHUNK pairs: a prompt chunk prefilled beside running decodes"},
    )
    mixed_context: int = field(
        default=256, metadata={"help": "cached tokens of the decodes in a mixed sample"}
    )
    repeats: int = field(
        default=3,
        metadata={"help": "timed steps per shape in a row (after one warm-up step)"},
    )
    rounds: int = field(
        default=3, metadata={"help": "passes over the whole grid (their times are pooled)"}
    )

    def __post_init__(self) -> None:
        sizes = [*self.batch_sizes, *self.context_lens, *self.prefill_lens, self.prefill_batch]
        sizes += [v for pair in self.mixed for v in pair]
        sizes += [self.mixed_context, self.repeats, self.rounds]
        if any(not isinstance(v, int) or v <= 0 for v in sizes):
            raise ValueError("every size, length and repeat count must be a positive integer")


def _sample(kind: str, starts: list[int], tokens: list[int], seconds: list[float]) -> dict:
    return {
        "kind": kind,
        "start_positions": starts,
        "num_tokens": tokens,
        "num_sampled": len(tokens),
        "seconds": seconds,
    }


class StepTimer:
    """Builds plans for one runner and times `execute`. Not thread-safe; one owner."""

    def __init__(self, runner: Any) -> None:
        ready = runner.ready_message(0)
        self.runner = runner
        self.block_size: int = ready.block_size
        self.num_blocks: int = ready.num_blocks
        self._rng = random.Random(0)
        self._writer = PlanWriter()  # plans carry only what changed, as the scheduler's do
        self._serial = 0
        self._next_block = 0  # blocks [0, _next_block) are held by live sequences

    def run(
        self,
        new_seqs: list[NewSequence],
        scheduled: dict[str, int],
        released: Optional[list[str]] = None,
    ) -> tuple[float, dict[str, int]]:
        """Execute one plan in which the rids of `scheduled` compute that many tokens each
        (to the end of their histories: every one samples); (wall seconds, rid -> token)."""
        plan = self._writer.plan(scheduled, new_seqs, released=released or [])
        start = time.perf_counter()
        result = self.runner.execute(plan)
        seconds = time.perf_counter() - start
        # every scheduled rid samples (the docstring's rule)
        return seconds, self._writer.samplers(plan, result.token_ids, set(scheduled))

    def new_seqs(self, batch: int, prompt_len: int, max_len: int) -> list[NewSequence]:
        """`batch` fresh requests with random prompts and whole block tables for max_len."""
        blocks_each = -(-max_len // self.block_size)
        if self._next_block + batch * blocks_each > self.num_blocks:
            raise ValueError(f"{batch} x {max_len} tokens exceed the worker's KV pool")
        seqs = []
        for _ in range(batch):
            self._serial += 1
            prompt = [self._rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(prompt_len)]
            blocks = list(range(self._next_block, self._next_block + blocks_each))
            self._next_block += blocks_each
            params = SamplingParams(max_tokens=max_len, temperature=0.0, ignore_eos=True)
            seqs.append(
                self._writer.new_sequence(f"m{self._serial}", prompt, prompt_len, blocks, params)
            )
        return seqs

    def prefill(self, seqs: list[NewSequence]) -> tuple[float, dict[str, int]]:
        return self.run(seqs, {s.rid: len(s.token_ids) for s in seqs})

    def release_all(self, rids: list[str]) -> None:
        """Release every live sequence (they must be exactly `rids`); blocks start over."""
        self.run([], {}, released=rids)
        self._next_block = 0

    def running(self, batch: int, ctx: int, extra: int) -> tuple[list[str], dict[str, int]]:
        """`batch` sequences with `ctx` tokens prefilled (untimed), room for `extra` more."""
        seqs = self.new_seqs(batch, ctx, ctx + extra)
        last: dict[str, int] = {}
        per_step = max(1, MAX_PREFILL_TOKENS // ctx)
        for i in range(0, batch, per_step):
            last.update(self.prefill(seqs[i : i + per_step])[1])
        return [s.rid for s in seqs], last

    def decode_sample(self, batch: int, ctx: int, repeats: int) -> dict:
        """`repeats` timed decode steps of `batch` sequences at context ~`ctx` (one sample:
        the context grows by one token a step, which is noise next to `ctx`)."""
        rids, last = self.running(batch, ctx, repeats + 2)
        seconds = []
        for _ in range(repeats + 1):  # the first decode is a warm-up for this shape
            t, sampled = self.run([], dict.fromkeys(rids, 1))  # decodes of their own samples
            last.update(sampled)
            seconds.append(t)
        self.release_all(rids)
        return _sample("decode", [ctx + 1] * batch, [1] * batch, seconds[1:])

    def prefill_sample(self, batch: int, prompt_len: int, repeats: int) -> dict:
        """`batch` fresh prompts of `prompt_len` tokens in one step, timed `repeats` times."""
        seconds = []
        for _ in range(repeats + 1):  # the first is a warm-up for this shape
            seqs = self.new_seqs(batch, prompt_len, prompt_len + 1)
            seconds.append(self.prefill(seqs)[0])
            self.release_all([s.rid for s in seqs])
        return _sample("prefill", [0] * batch, [prompt_len] * batch, seconds[1:])

    def mixed_sample(self, batch: int, chunk: int, ctx: int, repeats: int) -> dict:
        """A fresh prompt of `chunk` tokens prefilled beside `batch` decodes at context ~ctx,
        timed `repeats` times (one sample)."""
        rids, last = self.running(batch, ctx, repeats + 2)
        seconds = []
        for _ in range(repeats + 1):  # the first is a warm-up for this shape
            (new,) = self.new_seqs(1, chunk, chunk + 1)
            t, sampled = self.run([new], {new.rid: chunk, **dict.fromkeys(rids, 1)})
            last.update(sampled)
            self.run([], {}, released=[new.rid])  # its blocks stay taken: no reuse
            seconds.append(t)
        self.release_all(rids)
        return _sample("mixed", [0] + [ctx + 1] * batch, [chunk] + [1] * batch, seconds[1:])


def collect_timings(
    runner: Any, grid: MeasureGrid, progress: Optional[Callable[[str], None]] = None
) -> list[dict]:
    """Time every shape of `grid` on `runner`, `grid.rounds` times over; the `samples` of a
    timings file, one per shape, holding its times from every round. Rounds (rather than more
    repeats in a row) spread each shape's times over the whole run, so a spell of slowness on
    a shared machine touches a few times of every shape instead of all times of a few."""
    timer = StepTimer(runner)
    say = progress or (lambda _text: None)
    samples = _one_round(timer, grid, say)
    for r in range(1, grid.rounds):
        say(f"round {r + 1} of {grid.rounds}")
        for sample, again in zip(samples, _one_round(timer, grid, say), strict=True):
            sample["seconds"] += again["seconds"]
    return samples


def _one_round(timer: StepTimer, grid: MeasureGrid, say: Callable[[str], None]) -> list[dict]:
    samples: list[dict] = []
    for ctx in grid.context_lens:
        for b in grid.batch_sizes:
            samples.append(timer.decode_sample(b, ctx, grid.repeats))
            say(f"decode B={b} ctx={ctx}: {_ms(samples[-1:])}")
    for n in grid.prefill_lens:
        for b in sorted({1, grid.prefill_batch}):
            samples.append(timer.prefill_sample(b, n, grid.repeats))
            say(f"prefill B={b} len={n}: {_ms(samples[-1:])}")
    for b, chunk in grid.mixed:
        samples.append(timer.mixed_sample(b, chunk, grid.mixed_context, grid.repeats))
        say(f"mixed {chunk}-token chunk + {b} decodes: {_ms(samples[-1:])}")
    return samples


def _ms(samples: list[dict]) -> str:
    return ", ".join(f"{1e3 * s:.1f}" for x in samples for s in x["seconds"]) + " ms"
