"""Scheduler <-> worker channel: the step contract (docs/design/step_contract.md).

One `StepPlan` per iteration goes to every worker rank; rank 0 answers with one `StepResult`.
The scheduler owns all scheduling state; the worker keeps a persistent batch (shared/
held_batch.py): per sequence its token history, block table, computed count and sampling
parameters, in a slot, dropped on `released_slots`. A plan carries only what changed, so a
steady step of hundreds of decodes is a few dozen bytes to build, encode and decode.
Lists inside these frozen messages are read-only by convention.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Optional

from shared.protocol.kv_channel import KvHandover
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
    quantization: str = "none"  # what the weights are: "none", "gguf", "q4_1", "int8", ...
    kv_cache_dtype: str = ""  # the KV pool's storage dtype ("": the compute dtype)
    # speculative decoding: the worker's proposer ("ngram", "sim"); None: it does not
    # speculate, so the scheduler gives no draft limits (docs/design/speculation.md)
    proposer: Optional[str] = None
    kv_endpoint: str = ""  # where decode workers pull its leased KV (per rank, space-separated)

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
    """A request new to the worker's batch: first scheduled, or resumed after preemption.

    It takes `slot` in the worker's persistent batch (a slot released by this plan or earlier
    may be reused). `num_computed_tokens` of its tokens are in the KV cache already (a prefix
    cache hit, else 0); computing starts there.
    """

    rid: str
    token_ids: list[int]  # every token so far: prompt, then output already generated
    num_prompt_tokens: int  # token_ids[num_prompt_tokens:] are outputs (penalties, seed index)
    block_ids: list[int]  # its whole block table at this step
    sampling: SamplingParams
    slot: int  # its place in the worker's batch until released
    num_computed_tokens: int = 0  # tokens of token_ids whose KV its blocks hold already
    traceparent: Optional[str] = None  # its request's frontend span (tracing on): step links


@dataclass(frozen=True, slots=True)
class PlanDrafts:
    """A plan's speculation columns (docs/design/speculation.md): one optional field of the
    plan, so a plan without them costs nothing more to build, encode or decode."""

    slots: list[int] = field(default_factory=list)  # [D] decodes that may also compute...
    limits: list[int] = field(default_factory=list)  # [D] ...up to this many drafts (>= 1)
    trim_slots: list[int] = field(default_factory=list)  # [R] tables cut, before appends...
    trim_lens: list[int] = field(default_factory=list)  # [R] ...to this many blocks


@dataclass(frozen=True, slots=True)
class DraftOutcome:
    """A result's speculation columns: sampler row `rows[j]` (an index into the result's
    token_ids) proposed `proposed[j]` drafts, of which the first `accepted[j]` were accepted;
    its tokens this step are those drafts (in `token_ids`, concatenated in row order), then the
    result's token for that row. `logprobs` (None unless a drafting row's request asked for
    logprobs): one per accepted draft of the rows whose request asked, in row order."""

    rows: list[int] = field(default_factory=list)  # [J]
    proposed: list[int] = field(default_factory=list)  # [J]
    accepted: list[int] = field(default_factory=list)  # [J]
    token_ids: list[int] = field(default_factory=list)  # [sum(accepted)]
    logprobs: Optional[list[TokenLogprobs]] = None  # [sum(accepted) of the rows that asked]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Scheduler -> worker, one per iteration: only what changed in the worker's batch.

    The worker keeps a persistent batch of sequences, each in a slot, each with its token
    history (its own samples appended), block table and computed-token count. Applying a plan:

    1. with `prev_step_id` None the worker first drops every sequence it holds (a reset);
       otherwise `prev_step_id` must be the last plan it applied (else: an error, never a guess);
    2. drop the sequences in `released_slots`; add `new_seqs` in their slots;
    3. append `block_ids[j]` to the table of the sequence in `block_slots[j]` (in order);
    4. every held sequence computes 1 token (a decode of its last sample) unless it is listed in
       `count_slots`, then `counts[j]` tokens (a prefill chunk; 0: it waits this step), from its
       computed count on; it samples when that reaches the end of its token history.
    5. speculation (`drafts`, `PlanDrafts`): a decode listed there also computes up to its
       limit of drafts (not counted in `num_scheduled_tokens`); its trims cut tables between
       steps 2 and 3.

    Checked by `check_plan` (structure) and by the worker (state): after step 2 it holds exactly
    `num_seqs` sequences and computes `num_scheduled_tokens` tokens; a sequence never computes
    past its history, its block table or max_model_len. The list fields are omitted on the wire
    when empty, so a steady step of decodes costs a few dozen bytes whatever the batch size.
    """

    step_id: int
    prev_step_id: Optional[int]  # the plan this one extends; None: the worker's batch is reset
    num_seqs: int  # sequences held after releases and new_seqs
    num_scheduled_tokens: int  # tokens computed this step, over every held sequence
    new_seqs: list[NewSequence] = field(default_factory=list)
    released_slots: list[int] = field(default_factory=list)  # drop these first
    block_slots: list[int] = field(default_factory=list)  # [A] which sequence gets...
    block_ids: list[int] = field(default_factory=list)  # [A] ...this block appended
    count_slots: list[int] = field(default_factory=list)  # [C] sequences that do not...
    counts: list[int] = field(default_factory=list)  # [C] ...compute exactly 1 token
    drafts: Optional[PlanDrafts] = None  # speculation; None (omitted on the wire) when off


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities for one sampled token (only for requests that asked)."""

    logprob: float  # of the chosen token, from the processed distribution
    top_token_ids: list[int]  # [k] most likely tokens, best first
    top_logprobs: list[float]  # [k]


@dataclass(frozen=True, slots=True)
class StepResult:
    """Worker (rank 0) -> scheduler, one per plan, same `step_id`.

    `token_ids[i]` is the sample of the i-th sequence that sampled in this step, in the
    worker's batch order (the order its sequences joined: worker/held_batch.py). No rids: the
    scheduler keeps the same order and maps tokens by position, so a steady result is one
    integer per sequence on the wire. `logprobs` is keyed by rid (only requests that asked),
    so are `embeddings` (only embedding requests).
    """

    step_id: int
    token_ids: list[int]  # [S]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    forward_s: float = 0.0  # time the worker spent on this step (prepare + forward + sample)
    # embedding requests (sampling.pooling) that sampled: rid -> pooled hidden state [Hd]
    embeddings: dict[str, list[float]] = field(default_factory=dict)
    drafts: Optional[DraftOutcome] = None  # speculation; None when nothing was drafted


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


# ---- disaggregation: KV hand-over (docs/design/disaggregation.md) ----------------------------


@dataclass(frozen=True, slots=True)
class GrantLease:
    """Scheduler -> prefill worker: `block_ids` hold a finished prefill's KV and may be read
    (shared/protocol/kv_channel.py) under this lease until `EndLease`. Sent before the
    hand-over reaches any frontend."""

    lease_id: int
    generation: int
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class EndLease:
    """Scheduler -> prefill worker: the lease is over (confirmed or expired); sent before any
    plan that may reuse its blocks, so a later read is refused."""

    lease_id: int


@dataclass(frozen=True, slots=True)
class PullKv:
    """Scheduler -> decode worker: copy `source`'s blocks from the prefill worker into
    `block_ids` (allocated to this pull alone), then answer `KvPulled`."""

    rid: str
    source: KvHandover
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class KvPulled:
    """Decode worker -> scheduler: the answer to `PullKv` (`ok` False: nothing usable was
    written; `code` says why), one per rank of the worker."""

    rid: str
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    code: str = ""
    message: str = ""
    # a tensor-parallel decode worker: every rank pulls its own KV-head shard and answers
    # (`rank` of `world_size`); the scheduler admits the request once all have answered
    rank: int = 0
    world_size: int = 1


def check_plan(plan: StepPlan) -> None:
    """Raise ValueError if the plan contradicts itself (cheap structural checks; the worker's
    persistent batch checks the plan against what it holds)."""
    if len(plan.block_slots) != len(plan.block_ids):
        raise ValueError("step plan block_slots and block_ids differ in length")
    if len(plan.count_slots) != len(plan.counts):
        raise ValueError("step plan count_slots and counts differ in length")
    drafts = plan.drafts or PlanDrafts()
    if len(drafts.slots) != len(drafts.limits) or len(drafts.trim_slots) != len(drafts.trim_lens):
        raise ValueError("step plan draft or trim columns differ in length")
    if len(set(drafts.slots)) != len(drafts.slots) or any(n < 1 for n in drafts.limits):
        raise ValueError("step plan gives a slot two draft limits, or one below 1")
    if len(set(drafts.trim_slots)) != len(drafts.trim_slots) or any(
        n < 0 for n in drafts.trim_lens
    ):
        raise ValueError("step plan trims a slot twice, or to a negative length")
    if len(set(plan.count_slots)) != len(plan.count_slots):
        raise ValueError("step plan gives a slot two token counts")
    if plan.num_seqs < 0 or plan.num_scheduled_tokens < 0 or any(c < 0 for c in plan.counts):
        raise ValueError("step plan has a negative count")
    slots = [s.slot for s in plan.new_seqs]
    if len(set(slots)) != len(slots) or len(set(plan.released_slots)) != len(plan.released_slots):
        raise ValueError("step plan adds or releases a slot twice")
    named = (*slots, *plan.released_slots, *plan.block_slots, *plan.count_slots,
             *drafts.slots, *drafts.trim_slots)  # fmt: skip
    if any(s < 0 for s in named):
        raise ValueError("step plan names a negative slot")
    for seq in plan.new_seqs:
        if not 0 <= seq.num_computed_tokens < len(seq.token_ids):
            raise ValueError(f"new sequence {seq.rid!r}: num_computed_tokens out of range")
        if not 0 < seq.num_prompt_tokens <= len(seq.token_ids):
            raise ValueError(f"new sequence {seq.rid!r}: num_prompt_tokens out of range")


def default_seed(rid: str) -> int:
    """The seed of a request that has none: a stable function of its rid (crc32: the same in
    every process and run, unlike Python's salted hash()). The frontend pins it on every
    sampled request it submits, so that a resumption under another rid draws the same."""
    return zlib.crc32(rid.encode("utf-8"))


def worker_identity(rank: int) -> bytes:
    """Routing identity of a rank's socket (the scheduler addresses plans with it)."""
    return f"worker-{rank}".encode()
