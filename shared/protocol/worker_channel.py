"""Scheduler <-> worker channel: the step contract (docs/design/step_contract.md).

One `StepPlan` per iteration goes to every worker rank; rank 0 answers with one `StepResult`.
The scheduler owns all scheduling state; the worker keeps only what a plan tells it:
per-request token history, block table and sampling parameters, dropped on `released_rids`.

Scheduled work is columnar (parallel lists, one entry per scheduled sequence, in batch order)
because a plan with hundreds of decodes must be cheap to build, encode and decode.
Lists inside these frozen messages are read-only by convention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from shared.protocol.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """Worker -> scheduler, once, after the model and the KV cache are allocated."""

    rank: int
    num_blocks: int  # KV blocks in the pool, measured by the worker
    block_size: int  # tokens per block
    max_model_len: int  # prompt + output tokens one sequence may hold
    model_name: str
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str  # "float32" | "bfloat16" | ...
    device: str  # "cpu" | "cuda:0" | "sim:h200" ...
    world_size: int = 1  # ranks of its tensor-parallel group (the scheduler waits for all)
    weight_bytes: int = 0  # model weights this rank holds (its shard); 0: not reported
    kv_cache_bytes: int = 0  # this rank's KV pool (its share of the KV heads); 0: not reported

    def __post_init__(self) -> None:
        # Checked on decode (the codec turns this into invalid_field): a WorkerReady that
        # could not size a scheduler is refused before it reaches one.
        counts = (self.rank >= 0, self.num_blocks >= 1, self.block_size >= 1,
                  self.max_model_len >= 2, self.vocab_size >= 1, self.world_size > self.rank,
                  self.weight_bytes >= 0, self.kv_cache_bytes >= 0)  # fmt: skip
        if not all(counts):
            raise ValueError(
                "WorkerReady needs rank >= 0, num_blocks >= 1, block_size >= 1, "
                "max_model_len >= 2, vocab_size >= 1, world_size > rank and byte counts >= 0"
            )


@dataclass(frozen=True, slots=True)
class NewSequence:
    """A request new to the worker: first scheduled, or resumed after preemption.

    The worker forgets any earlier state of a resumed `rid` and starts from this.
    """

    rid: str
    token_ids: list[int]  # every token so far: prompt, then output already generated
    num_prompt_tokens: int  # token_ids[num_prompt_tokens:] are outputs (penalties, seed index)
    block_ids: list[int]  # its whole block table at this step
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Scheduler -> worker, one per iteration. Invariants (checked by `check_plan`):

    * every scheduled rid is either in `new_seqs` of this plan or was scheduled before and not
      released since; a rid appears at most once;
    * `token_ids` is the concatenation of each sequence's tokens for this step
      (len == sum(num_tokens)); sequence i computes positions
      start_positions[i] .. start_positions[i] + num_tokens[i] - 1;
    * after appending `new_block_ids[i]`, the block table covers every computed position;
    * `sample[i]` is true for decodes and for the last chunk of a prompt.
    """

    step_id: int
    new_seqs: list[NewSequence]
    rids: list[str]  # [B]
    start_positions: list[int]  # [B] == tokens already in the KV cache for that sequence
    num_tokens: list[int]  # [B] tokens computed this step (1 for a decode)
    token_ids: list[int]  # [sum(num_tokens)] flattened
    new_block_ids: list[list[int]]  # [B] blocks appended since the previous plan
    sample: list[bool]  # [B]
    released_rids: list[str] = field(default_factory=list)  # drop their state first

    @property
    def num_seqs(self) -> int:
        return len(self.rids)

    @property
    def total_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities for one sampled token (only for requests that asked)."""

    logprob: float  # of the chosen token, from the processed distribution
    top_token_ids: list[int]  # [k] most likely tokens, best first
    top_logprobs: list[float]  # [k]


@dataclass(frozen=True, slots=True)
class StepResult:
    """Worker (rank 0) -> scheduler, one per plan, same `step_id`.

    `rids[i]` sampled `token_ids[i]`; only sequences with `sample` true appear, in plan order.
    """

    step_id: int
    rids: list[str]
    token_ids: list[int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    forward_s: float = 0.0  # time the worker spent on this step (prepare + forward + sample)


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """Worker -> scheduler: the step could not run (e.g. out of memory). Fatal for the step."""

    step_id: Optional[int]
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class WorkerShutdown:
    """Scheduler -> worker: stop after this message. `restart`: the worker's tensor-parallel
    group lost a rank, so it exits with a failure code for its supervisor to restart the
    group (a rank cannot rejoin a group whose other members live on)."""

    reason: str = ""
    restart: bool = False


def check_plan(plan: StepPlan) -> None:
    """Raise ValueError if the plan's columns disagree (cheap structural checks)."""
    n = len(plan.rids)
    cols = (plan.start_positions, plan.num_tokens, plan.new_block_ids, plan.sample)
    if any(len(c) != n for c in cols):
        raise ValueError("step plan columns have different lengths")
    if sum(plan.num_tokens) != len(plan.token_ids):
        raise ValueError("step plan token_ids length != sum(num_tokens)")
    if len(set(plan.rids)) != n:
        raise ValueError("step plan schedules a rid twice")
    if any(t <= 0 for t in plan.num_tokens) or any(p < 0 for p in plan.start_positions):
        raise ValueError("step plan has an empty chunk or a negative position")
