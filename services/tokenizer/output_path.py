"""The frontend's output path: one step's OutputBatch from a scheduler -> frames to clients.

A part of `FrontendServer` (services/tokenizer/server.py), kept in its own module because it is
the code that runs for every token of every request: with hundreds of requests running, the
frontend handles one batch per engine step, and its per-token cost is what the frontend adds to
each step on a shared CPU. A token of a quiet request (`ClientRequest.quiet`: not streamed, no
stop strings, no logprobs) that does not end it is appended in place; every other output goes
through `ClientRequest.on_token` / `on_output` (detokenizer, stop strings, frames).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

from services.tokenizer.engine_link import EngineLink
from services.tokenizer.latency_window import LatencyWindow
from services.tokenizer.request_state import ClientRequest, Progress
from shared.protocol.codec import encode
from shared.protocol.engine_channel import AbortRequest, OutputBatch, RequestTimings


class OutputPath:
    """Mixed into FrontendServer; uses its `_requests`, `_engines`, `_clients`, `_latency`,
    `log` and `_forget`."""

    _requests: dict[str, ClientRequest]
    _engines: list[EngineLink]
    _clients: Any
    _latency: LatencyWindow
    log: Any
    _forget: Callable[[str], ClientRequest]  # drops the request from the table and router

    def _on_outputs(self, link: EngineLink, batch: OutputBatch) -> None:
        """One step's outputs: first the tokens of requests that go on, then final outputs.
        Outputs for a request that now runs elsewhere (resubmitted) are dropped."""
        now = time.monotonic()
        logprobs = batch.logprobs
        engine = link.index
        get = self._requests.get
        for rid, token in zip(batch.rids, batch.token_ids, strict=True):
            state = get(rid)
            if state is None or state.engine != engine:
                continue  # ended here already
            if state.quiet and state.first_token_at is not None:
                state.token_ids.append(token)  # what on_token would do for it, inline
                state.last_token_at = now
                continue
            lps = logprobs.get(rid) if logprobs else None
            self._deliver(rid, state, state.on_token(token, lps, now), None, now)
        for out in batch.finished:
            state = get(out.rid)
            if state is not None and state.engine == engine:
                self._deliver(out.rid, state, state.on_output(out, now), out.timings, now)

    def _deliver(
        self,
        rid: str,
        state: ClientRequest,
        progress: Progress,
        engine_timings: Optional[RequestTimings],
        now: float,
    ) -> None:
        """Send a request's frames; when it finished here, forget it (and abort it in the
        engine if only a stop string ended it)."""
        if progress.finished:
            self._forget(rid)
            if progress.abort_in_engine:
                self._engines[state.engine].send(encode(AbortRequest(rid, "stop_string")))
            timings = state.timings(engine_timings, now)
            self.log.info(
                "request_finished", rid=rid, finish_reason=progress.finish_reason,
                num_output_tokens=len(state.token_ids), ttft_s=timings.ttft_s,
                tpot_s=timings.tpot_s, e2e_s=timings.e2e_s, queue_s=timings.queue_s,
                engine=self._engines[state.engine].name,
            )  # fmt: skip
            self._latency.record(now, timings.ttft_s, timings.tpot_s)
        for frame in progress.frames:
            if not self._clients.send(state.identity, frame):
                break
