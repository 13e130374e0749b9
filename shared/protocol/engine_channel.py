"""Frontend (tokenizer service) <-> scheduler channel.

Frontends connect DEALER sockets (each with its own identity) to the scheduler's ROUTER; the
scheduler answers each request on the frontend identity it came from. Request ids (`rid`) are
made globally unique by the frontend (they embed the frontend's id).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import TokenLogprobs

# ---- frontend -> scheduler -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FrontendHello:
    """Sent when a frontend connects and every second after (heartbeat)."""

    frontend_id: str


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    rid: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0  # lower runs first under the `priority` policy
    arrival_time: float = 0.0  # frontend's wall clock (time.time()) at receipt
    traceparent: Optional[str] = None  # the frontend's request span (tracing on), W3C


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Idempotent: aborting an unknown or finished rid is a no-op."""

    rid: str
    reason: str = "abort"


@dataclass(frozen=True, slots=True)
class StatsQuery:
    query_id: str


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Empty the prefix cache (blocks in use stay in use but are no longer findable); answered
    with `PrefixCacheReset`, same `query_id`."""

    query_id: str


@dataclass(frozen=True, slots=True)
class FrontendBye:
    """The frontend is shutting down: abort all its requests."""

    frontend_id: str


# ---- scheduler -> frontend -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineReady:
    """Sent to every frontend after the worker handshake (and in answer to FrontendHello).

    Its load fields are the engine's load when sent (once per FrontendHello, i.e. per
    heartbeat): a frontend with several engines routes by them (services/tokenizer/router.py).
    """

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int
    num_waiting: int = 0  # requests queued
    num_running: int = 0  # requests in the running batch
    kv_usage: float = 0.0  # fraction of KV blocks in use
    prefix_caching: bool = True  # whether this engine keeps a prefix cache


@dataclass(frozen=True, slots=True)
class EngineNotReady:
    """The worker is gone (or not yet ready): in-flight requests were failed."""

    reason: str


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Scheduler clock (time.time()) per request; None until it happened."""

    arrival: float
    first_scheduled: Optional[float]
    first_token: Optional[float]
    finished: Optional[float]
    num_preemptions: int = 0


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """New tokens for one request. In an `OutputBatch` only final outputs (finish_reason
    set, timings attached) travel as objects; a request that goes on travels in its columns.

    finish_reason: "stop" (eos or a stop token), "length" (max_tokens or max_model_len),
    "abort", or "error" (then `error_code`/`error_message` say why).
    """

    rid: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per new token, if asked
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    timings: Optional[RequestTimings] = None  # set on the final output
    error_code: Optional[str] = None
    error_message: Optional[str] = None
    # prompt tokens whose KV came from the prefix cache when the request was first scheduled
    num_cached_tokens: int = 0
    embedding: Optional[list[float]] = None  # an embedding request's pooled state (final)


@dataclass(frozen=True, slots=True)
class OutputBatch:
    """All outputs of one step for one frontend, columnar.

    The common case, a request that goes on with one new token, costs two list entries
    rather than a message object each (hundreds per step; see docs/PERFORMANCE.md):

    * `rids[i]` got `token_ids[i]` this step and is not finished; `logprobs` has an entry for
      each of these rids that asked for logprobs;
    * `finished` holds final outputs (their last new tokens included), applied after the
      columns. A rid appears at most once in a batch.
    """

    step_id: int
    rids: list[str] = field(default_factory=list)  # [N]
    token_ids: list[int] = field(default_factory=list)  # [N]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    finished: list[RequestOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.rids) != len(self.token_ids):
            raise ValueError("output batch rids and token_ids differ in length")

    def __len__(self) -> int:
        return len(self.rids) + len(self.finished)

    def as_outputs(self) -> list[RequestOutput]:
        """Every entry as a RequestOutput, columns first (for tools and tests; the frontend
        reads the columns). Token counts and timings are set on final outputs only."""
        lps = self.logprobs
        outs = [
            RequestOutput(rid, [tok], None, [lps[rid]] if rid in lps else [])
            for rid, tok in zip(self.rids, self.token_ids, strict=True)
        ]
        return outs + self.finished


@dataclass(frozen=True, slots=True)
class RequestRejected:
    """The scheduler refused a request at admission (e.g. too long, overloaded)."""

    rid: str
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class StatsReply:
    query_id: str
    stats: dict[str, float]


@dataclass(frozen=True, slots=True)
class PrefixCacheReset:
    """The answer to `ResetPrefixCache`: how many cached blocks were dropped."""

    query_id: str
    num_blocks_dropped: int


@dataclass(frozen=True, slots=True)
class EngineShutdown:
    """Either direction on a control path: stop cleanly."""

    reason: str = ""
