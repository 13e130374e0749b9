"""One request's scheduling state.

There is no prefill or decode phase field: `num_computed_tokens` catches up to `len(token_ids)`.
After (re)admission the request is in prefill while `num_computed_tokens < prefill_len`; once the
last prompt chunk has been computed it samples, and from then on each step computes the one token
sampled last (a decode).

Its `status` and its block table (`block_ids`) change only through its own methods below, which
the scheduler's parts call (services/scheduler/running.py, live.py, prefix_cache.py): a status
moves WAITING -> RUNNING (`start`), RUNNING -> WAITING (`requeue`, its table released first) and
any -> FINISHED (`finish`, once). The counters the step builder and the result path advance on
every step (`num_computed_tokens`, `token_ids`) stay plain fields: a method call per request per
step is what the result -> plan path cannot afford.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from shared.protocol.engine_channel import RequestOutput, RequestTimings
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue (new, or preempted and waiting to recompute)
    RUNNING = "running"  # holds a slot in the batch (and blocks once it has been scheduled)
    FINISHED = "finished"  # stop, length, abort or error; no longer live


@dataclass(slots=True, eq=False)
class Request:
    rid: str
    token_ids: list[int]  # prompt, then every output token sampled so far
    num_prompt_tokens: int
    sampling: SamplingParams
    priority: int
    seq_no: int  # admission order at add_request: breaks ties, defines "arrival" order
    arrival_time: float  # scheduler clock
    # finishes ("length") once len(token_ids) reaches this: prompt + max_tokens, capped by
    # max_model_len and by what the whole KV pool can hold
    max_len: int
    stop_ids: frozenset[int]  # eos (unless ignore_eos) and sampling.stop_token_ids
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (as of the last plan)
    # speculation: draft positions the plans in flight may have written past
    # num_computed_tokens (their results say how many were accepted); its table covers them
    num_draft_slots: int = 0
    prefill_len: int = 0  # len(token_ids) when (re)admitted: work up to here is prefill
    block_ids: list[int] = field(default_factory=list)  # its block table (read-only outside)
    num_sent_blocks: int = 0  # how many of block_ids the worker already knows
    slot: Optional[int] = None  # its slot in the worker's batch (sent, not yet released)
    protected: bool = False  # just resumed after preemption: not the next victim
    padding: bool = False  # static batching: finished, but keeps its slot and is still computed
    preempted_at_step: Optional[int] = None  # the schedule() round that preempted it
    # RunningSet.version right after its latest preemption: a sample of a plan built before
    # it (InFlightStep.version lower) is stale, whatever the request has recomputed since
    preempted_at_version: Optional[int] = None
    num_preemptions: int = 0
    num_worker_retries: int = 0  # times it restarted because the worker was lost
    # prefix caching: content keys of its full blocks (tokens only decide them, so they are
    # kept across preemption), how many of its table's blocks are registered or were hits,
    # and the prompt tokens found cached when it was first scheduled
    block_keys: list[int] = field(default_factory=list)  # shared/prefix_hash.py, as ints
    num_registered_blocks: int = 0
    num_cached_tokens: Optional[int] = None
    num_draft_tokens: int = 0  # drafts the worker verified for it, since admission
    num_accepted_tokens: int = 0  # ... and accepted
    first_scheduled: Optional[float] = None
    first_token: Optional[float] = None
    finished: Optional[float] = None
    finish_reason: Optional[str] = None
    # latency targets under `--policy slo` (slo_policy.py, decided on arrival): its TTFT
    # deadline (scheduler clock), TPOT target in seconds, served after those that can make theirs
    ttft_deadline: Optional[float] = None
    tpot_s: Optional[float] = None
    best_effort: bool = False
    # tracing (shared/tracing.py): the frontend's request span, and when it was preempted
    traceparent: Optional[str] = None
    preempted_times: Optional[list[float]] = None
    # disaggregation: ends "handover" after its first token, its KV leased (handover.py)
    hands_over: bool = False

    @property
    def known_to_worker(self) -> bool:
        return self.slot is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    # ---- status ------------------------------------------------------------------------------

    def start(self) -> None:
        """Joins the running batch (RunningSet.start): everything it holds is prefill until it
        samples."""
        self.status = RequestStatus.RUNNING
        self.prefill_len = len(self.token_ids)

    def requeue(self) -> None:
        """Back to waiting, to recompute from token 0 (a preemption to the queue, a failed step,
        a lost worker); its table was released and `reset_for_recompute` called first."""
        if self.block_ids:
            raise ValueError(f"{self.rid} requeued while it holds blocks")
        self.status = RequestStatus.WAITING

    def finish(self, reason: str, now: float) -> None:
        """It stops being live (LiveRequests.finish); its final output follows."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finished = now

    def set_targets(self, ttft_deadline: float, tpot_s: Optional[float], best_effort: bool) -> None:
        """The slo policy's decision on arrival (before it is queued; never changed after)."""
        self.ttft_deadline, self.tpot_s, self.best_effort = ttft_deadline, tpot_s, best_effort

    def note_sampled(self, now: float) -> None:
        """Its first sample after (re)admission landed (the result path): no longer protected,
        and the first token's time is kept."""
        if self.first_token is None:
            self.first_token = now
        self.protected = False

    def forget_preemption(self) -> None:
        """Called when the scheduler's core is rebuilt (a lost worker): the running-set version
        its preemption was noted at belongs to the old core, whose plans are all gone. Kept, it
        would drop every sample of the new core's plans until their version passed it."""
        self.preempted_at_version = None

    def note_preempted(self, round_no: int, version: int) -> None:
        """It lost its blocks to another request (RunningSet.preempt) and will recompute: counted,
        protected from being the next victim until it samples again."""
        self.num_preemptions += 1
        if self.traceparent is not None:  # traced: its scheduler spans show when
            self.preempted_times = [*(self.preempted_times or []), time.time()]
        self.preempted_at_step = round_no
        self.preempted_at_version = version
        self.protected = True

    # ---- block table -------------------------------------------------------------------------

    def add_blocks(self, blocks: list[int]) -> None:
        """Blocks just allocated for it (RunningSet) join the end of its table."""
        self.block_ids.extend(blocks)

    def attach_cached(self, blocks: list[int], block_size: int) -> None:
        """A prefix-cache hit (PrefixCache.attach): its table starts with `blocks`, which count as
        computed and registered. Only for a request that holds nothing yet."""
        if self.block_ids or self.num_computed_tokens:
            raise ValueError(f"{self.rid} attached cached blocks to a table in use")
        self.block_ids = list(blocks)
        self.num_registered_blocks = len(blocks)
        self.num_computed_tokens = len(blocks) * block_size

    def release_table(self) -> list[int]:
        """Its table, which it no longer holds (the caller frees the blocks); drafts in
        flight go with it (their results are dropped)."""
        table, self.block_ids = self.block_ids, []
        self.num_draft_slots = 0
        return table

    def cut_table(self, num_blocks: int) -> list[int]:
        """The blocks of its table past the first `num_blocks`, which it no longer holds
        (RunningSet.give_back: rejected drafts)."""
        cut = self.block_ids[num_blocks:]
        del self.block_ids[num_blocks:]
        self.num_sent_blocks = min(self.num_sent_blocks, num_blocks)
        return cut

    def reset_for_recompute(self) -> None:
        """Called on preemption after its blocks and slot were released: it restarts from
        token 0."""
        self.num_computed_tokens = 0
        self.num_draft_slots = 0
        self.prefill_len = len(self.token_ids)
        self.block_ids = []
        self.num_sent_blocks = 0
        self.num_registered_blocks = 0
        self.slot = None

    # ---- what the frontend gets --------------------------------------------------------------

    def timings(self) -> RequestTimings:
        return RequestTimings(
            arrival=self.arrival_time,
            first_scheduled=self.first_scheduled,
            first_token=self.first_token,
            finished=self.finished,
            num_preemptions=self.num_preemptions,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )

    def output(
        self,
        new_token_ids: list[int],
        logprobs: list[TokenLogprobs],
        finish_reason: Optional[str] = None,
        error_code: Optional[str] = None,
        error_message: Optional[str] = None,
    ) -> RequestOutput:
        """What the frontend gets for this request now; the final one carries timings."""
        return RequestOutput(
            self.rid,
            new_token_ids,
            finish_reason,
            logprobs,
            self.num_prompt_tokens,
            len(self.token_ids) - self.num_prompt_tokens,
            None if finish_reason is None else self.timings(),
            error_code,
            error_message,
            self.num_cached_tokens or 0,
        )
