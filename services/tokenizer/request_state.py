"""One client request inside the frontend: from the scheduler's token ids to client replies.

Owns the request's detokenizer, stop strings, the text generated so far, every token id (and
logprob) it received, how much of them it streamed, its timings and the engine it runs on. The
output path (output_path.py) calls `on_token` for each new token of a request that goes on and
`on_output` for its final output; the request flow (request_flow.py) calls `route_to` when it
sends it to an engine and `abort` when the client aborts. Each returns the frames to send to the
client. Keeps no sockets.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.stop_strings import StopStrings
from services.tokenizer.tracing import RequestTrace
from shared.protocol.client_channel import (
    Timings,
    Usage,
    chunk_reply,
    done_reply,
    embedding_reply,
    error_reply,
)
from shared.protocol.engine_channel import RequestOutput, RequestTimings, SubmitRequest
from shared.protocol.errors import ErrorCode
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import TokenLogprobs


@dataclass(frozen=True, slots=True)
class Progress:
    """What one output did: frames for the client; whether the request is over; whether the
    scheduler must still be told to stop it (a stop string ended it before the engine did)."""

    frames: Sequence[bytes]
    finished: bool = False
    abort_in_engine: bool = False
    finish_reason: Optional[str] = None


# The common answer to a token (not streamed, or held back): one shared immutable instance,
# since a frozen dataclass costs about a microsecond to build and this runs per token.
NOTHING_TO_SEND = Progress(())


@dataclass
class ClientRequest:
    """Mutable per-request state; lives from admission until its terminal reply is sent.

    Its fields change only through its methods. Invariants (`check_invariants`): what was
    streamed or detokenized is a prefix of what was received, one logprob per token at most,
    a first token time exactly when a token came."""

    rid: str  # globally unique (embeds the frontend id); the scheduler's key
    client_id: str  # the client's `id` on its connection
    identity: bytes  # the client's ZeroMQ routing identity
    stream: bool
    sampling: SamplingParams
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    received_at: float = field(default_factory=time.monotonic)
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    text: str = ""  # generated text so far, cut at a stop string
    num_text_sent: int = 0  # characters of `text` already streamed
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_ids_sent: int = 0  # token ids already streamed
    # prompt tokens the engine found in its prefix cache; known from the engine's final output
    # (0 when the frontend ends the request first: a stop string, an abort)
    num_cached_tokens: int = 0
    # the engine running its current attempt (index in the frontend's scheduler list); None
    # while it waits for one (resumption.py)
    engine: Optional[int] = 0
    submit: Optional[SubmitRequest] = None  # its first attempt as sent: prompt, pinned sampling
    # Resumption (docs/design/resumption.md): each attempt runs under a rid of its own, so an
    # earlier attempt's late outputs find no request (fencing). Attempt 0 runs under `rid`.
    engine_rid: str = ""  # the current attempt's rid ("": `rid`)
    attempt: int = 0
    num_faults: int = 0  # attempts ended by an engine's loss or refusal (max_resumes)
    num_ids_detokenized: int = 0  # token ids already given to the detokenizer
    embedding: Optional[list[float]] = None  # an `embed`'s pooled state, from its final output
    trace: Optional[RequestTrace] = None  # its spans (tracing on): tracing.py
    # Not streamed, no stop strings, no logprobs: nobody reads anything of it before its final
    # output, so a token that does not end it only needs appending to `token_ids` (and
    # `last_token_at` set). Once its first token came (`first_token_at` set through
    # `on_token`), `in_place` says so, and the output path calls `append_in_place` for each
    # token instead of `on_token`: it runs for every token of every request, hundreds per step.
    quiet: bool = field(init=False)
    in_place: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.quiet = not self.stream and not self.stops.stops and self.sampling.logprobs is None
        self.engine_rid = self.engine_rid or self.rid

    def on_output(self, out: RequestOutput, now: float) -> Progress:
        """Apply one request's output (a final one, in an OutputBatch); the frames to send."""
        self.num_cached_tokens = out.num_cached_tokens
        self.embedding = out.embedding
        if out.new_token_ids:
            self._take(out.new_token_ids, out.logprobs, now)
        if out.finish_reason == "error":
            code = out.error_code or ErrorCode.WORKER_FAILED
            message = out.error_message or "the engine failed the request"
            return Progress([error_reply(code, message, self.client_id)], True, False, "error")
        return self._advance(out.finish_reason, out.timings, now)

    def on_token(self, token_id: int, logprobs: Optional[TokenLogprobs], now: float) -> Progress:
        """Apply one new token of a request that goes on (an OutputBatch column entry);
        NOTHING_TO_SEND (the shared instance) when there is nothing for the client yet."""
        self._take([token_id], [logprobs] if logprobs is not None else [], now)
        return self._advance(None, None, now)

    def append_in_place(self, token_id: int, now: float) -> None:
        """What `on_token` does for a token of a request that is `in_place`, at the cost of an
        append: it sends nothing, and the text waits for the final output."""
        self.token_ids.append(token_id)
        self.last_token_at = now

    def _take(self, new_ids: list[int], logprobs: list[TokenLogprobs], now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
            self.in_place = self.quiet
        self.last_token_at = now
        self.token_ids.extend(new_ids)
        self.logprobs.extend(logprobs)

    def _advance(
        self,
        finish_reason: Optional[str],
        engine_timings: Optional[RequestTimings],
        now: float,
    ) -> Progress:
        """Detokenize the ids not detokenized yet, look for stop strings; a chunk, or the final
        frames."""
        engine_done = finish_reason is not None
        if not engine_done and not self.stream and not self.stops.stops:
            return NOTHING_TO_SEND  # nobody reads the text before the end: the ids wait
        old_len = len(self.text)
        new_ids = self.token_ids[self.num_ids_detokenized :]
        self.num_ids_detokenized = len(self.token_ids)
        self.text += self.detokenizer.push(new_ids, final=engine_done)
        match = self.stops.find(self.text, old_len)
        if match is not None:
            self.text = self.text[: match.start]
            frames = self._final_frames("stop", match.stop, engine_timings, now)
            return Progress(frames, True, not engine_done, "stop")
        if engine_done:
            reason = finish_reason or "stop"
            frames = self._final_frames(reason, self._stop_token(reason), engine_timings, now)
            return Progress(frames, True, False, reason)
        if not self.stream:
            return NOTHING_TO_SEND
        safe_len = len(self.text) - self.stops.holdback(self.text)
        return Progress([self._chunk(safe_len)])

    def abort(self, now: float) -> list[bytes]:
        """The client aborted: the `done` that ends the request (text so far, usage so far)."""
        return self._final_frames("abort", None, None, now)

    def route_to(self, engine: Optional[int]) -> None:
        """Called once the engine `engine` took the request's current attempt (None: it waits
        for an engine): its outputs count from there only."""
        self.engine = engine

    def next_attempt(self, fault: bool) -> SubmitRequest:
        """Called when the current attempt is over on its engine (resumption.py): the next
        attempt, under a rid of its own, carrying every token received so far apart from the
        prompt. `fault`: the attempt ended by a loss or refusal (counted against the limit)."""
        self.attempt += 1
        self.num_faults += fault
        self.engine_rid = f"{self.rid}.{self.attempt}"
        self.engine = None
        return self.attempt_submit()

    def attempt_submit(self) -> SubmitRequest:
        """The current attempt as an engine gets it (sent again while it waits for one)."""
        first = self.submit
        assert first is not None, self.rid
        return dataclasses.replace(
            first, rid=self.engine_rid, output_token_ids=list(self.token_ids), attempt=self.attempt
        )

    def take_resumed(self, token_ids: list[int], text: str, now: float) -> bool:
        """A client resumed this request here (its `resume` field): the tokens and text it has
        count as generated and streamed. False when `text` is not what those tokens make."""
        for tok in token_ids:  # one at a time: text is released where the first frontend could
            self.text += self.detokenizer.push([tok])
        if not self.text.startswith(text):
            return False
        self.token_ids = list(token_ids)
        self.num_ids_detokenized = self.num_ids_sent = len(token_ids)
        self.num_text_sent = len(text)
        if token_ids:
            self.first_token_at = self.last_token_at = now
            self.in_place = self.quiet
        return True

    def ended_already(self, stop_ids: frozenset[int], now: float) -> Optional[Progress]:
        """For a request resumed by its client: the final frames when what it has is complete
        already (the frontend it left died between its last chunk and its `done`)."""
        match = self.stops.find(self.text, 0)
        if match is not None:
            self.text = self.text[: match.start]
            return Progress(self._final_frames("stop", match.stop, None, now), True, False, "stop")
        if self.token_ids and self.token_ids[-1] in stop_ids:
            frames = self._final_frames("stop", self._stop_token("stop"), None, now)
            return Progress(frames, True, False, "stop")
        if len(self.token_ids) >= self.sampling.max_tokens:
            return Progress(self._final_frames("length", None, None, now), True, False, "length")
        return None

    def error(self, code: str, message: str) -> bytes:
        """The `error` reply that ends this request when the frontend or engine fails it."""
        return error_reply(code, message, self.client_id)

    # ---- helpers -----------------------------------------------------------------------------

    def _stop_token(self, reason: str) -> Optional[int]:
        """The stop token id that ended the request (None for end-of-sequence or length)."""
        last = self.token_ids[-1] if self.token_ids else None
        if reason == "stop" and last is not None and last in self.sampling.stop_token_ids:
            return last
        return None

    def _chunk(self, text_end: int) -> bytes:
        text = self.text[self.num_text_sent : text_end]
        ids = self.token_ids[self.num_ids_sent :]
        logprobs = None
        if self.sampling.logprobs is not None:
            logprobs = self.logprobs[self.num_ids_sent :]
        self.num_text_sent = max(self.num_text_sent, text_end)
        self.num_ids_sent = len(self.token_ids)
        return chunk_reply(self.client_id, text, ids, logprobs)

    def _final_frames(
        self,
        reason: str,
        stop_reason: Union[str, int, None],
        engine_timings: Optional[RequestTimings],
        now: float,
    ) -> list[bytes]:
        if self.sampling.pooling is not None and reason != "abort":
            return [self._embedding_frame()]
        frames: list[bytes] = []
        whole = None
        if self.stream:
            if len(self.text) > self.num_text_sent or len(self.token_ids) > self.num_ids_sent:
                frames.append(self._chunk(len(self.text)))
        else:
            logprobs = self.logprobs if self.sampling.logprobs is not None else None
            whole = (self.text, self.token_ids, logprobs)
        usage = Usage(self.num_prompt_tokens, len(self.token_ids), self.num_cached_tokens)
        timings = self.timings(engine_timings, now)
        frames.append(done_reply(self.client_id, reason, stop_reason, usage, timings, whole))
        return frames

    def _embedding_frame(self) -> bytes:
        """An `embed`'s answer: its embedding (its sampled token is not shown), or an error
        when the worker computed none (the simulated worker does not)."""
        if self.embedding is None:
            msg = "the engine's worker returned no embedding (a simulated worker computes none)"
            return error_reply(ErrorCode.EMBEDDINGS_UNSUPPORTED, msg, self.client_id)
        usage = Usage(self.num_prompt_tokens, 0, self.num_cached_tokens)
        pooling = self.sampling.pooling or "last"
        return embedding_reply(self.client_id, self.embedding, pooling, usage)

    def timings(self, engine: Optional[RequestTimings], now: float) -> Timings:
        """Durations seen by the frontend; the queue time comes from the scheduler's clock."""
        queue_s = None
        if engine is not None and engine.first_scheduled is not None:
            queue_s = max(0.0, engine.first_scheduled - engine.arrival)
        ttft_s = tpot_s = None
        if self.first_token_at is not None:
            ttft_s = self.first_token_at - self.received_at
            if self.last_token_at is not None and len(self.token_ids) > 1:
                tpot_s = (self.last_token_at - self.first_token_at) / (len(self.token_ids) - 1)
        return Timings(queue_s, ttft_s, tpot_s, now - self.received_at)

    def check_invariants(self) -> None:
        """Read-only; raises AssertionError when the request's counters disagree."""
        num_ids = len(self.token_ids)
        assert 0 <= self.num_ids_sent <= num_ids, (self.rid, self.num_ids_sent, num_ids)
        assert 0 <= self.num_ids_detokenized <= num_ids, (self.rid, self.num_ids_detokenized)
        assert 0 <= self.num_text_sent <= len(self.text), (self.rid, self.num_text_sent)
        assert len(self.logprobs) <= num_ids, self.rid
        assert (self.first_token_at is None) == (num_ids == 0), self.rid
        assert self.quiet == (
            not self.stream and not self.stops.stops and self.sampling.logprobs is None
        )
        assert self.in_place == (self.quiet and self.first_token_at is not None), self.rid
        assert self.engine_rid == (self.rid if self.attempt == 0 else f"{self.rid}.{self.attempt}")
        assert 0 <= self.num_faults <= self.attempt, (self.rid, self.num_faults, self.attempt)
