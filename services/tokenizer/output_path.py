"""The frontend's output path: one step's OutputBatch from a scheduler -> frames to clients.

Kept in its own module because it is the code that runs for every token of every request: with
hundreds of requests running, the frontend handles one batch per engine step, and its per-token
cost is what the frontend adds to each step on a shared CPU. Each request's own state turns a
token into frames (`ClientRequest.on_token` / `on_output`: detokenizer, stop strings); a token
of a request that shows nothing before its end (`ClientRequest.in_place`) is only appended
(`append_in_place`). This path sends the frames and closes the requests that finished.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from services.tokenizer.client_link import ClientLink
from services.tokenizer.engine_link import EngineLink
from services.tokenizer.engines import Engines
from services.tokenizer.latency_window import LatencyWindow
from services.tokenizer.request_flow import RequestFlow
from services.tokenizer.request_state import NOTHING_TO_SEND, ClientRequest, Progress
from services.tokenizer.request_table import RequestTable
from shared.protocol.engine_channel import (
    AbortRequest,
    OutputBatch,
    RequestOutput,
    RequestTimings,
)


class OutputPath:
    """Called with each OutputBatch an engine sends (`on_outputs`). Reads the request table,
    closes finished requests through the request flow. Owns the latency window of the
    requests that finished in the last minute (for `stats`)."""

    def __init__(
        self,
        table: RequestTable,
        flow: RequestFlow,
        engines: Engines,
        clients: ClientLink,
        log: Any,
    ) -> None:
        self._table = table
        self._flow = flow
        self._engines = engines
        self._clients = clients
        self._log = log
        self._latency = LatencyWindow()  # TTFT/TPOT of the last minute, for `stats`

    def latency_percentiles(self, now: float) -> dict[str, float]:
        """The last minute's TTFT/TPOT percentiles (LatencyWindow.percentiles)."""
        return self._latency.percentiles(now)

    def on_outputs(self, link: EngineLink, batch: OutputBatch) -> None:
        """One step's outputs: first the tokens of requests that go on (one each, then several:
        speculation), then final outputs. Outputs of an earlier attempt of a request (it
        resumed: they carry the old attempt's rid, which finds nothing) or of another engine
        are dropped."""
        now = time.monotonic()
        logprobs = batch.logprobs
        engine = link.index
        get = self._table.get
        for rid, token in zip(batch.rids, batch.token_ids, strict=True):
            state = get(rid)
            if state is None or state.engine != engine:
                continue  # ended here already
            if state.in_place:
                state.append_in_place(token, now)
                continue
            lps = logprobs.get(rid) if logprobs else None
            self._deliver(rid, state, state.on_token(token, lps, now), None, now)
        for out in (*batch.multi, *batch.finished):  # multi: several tokens, not final
            state = get(out.rid)
            if out.handover is not None:  # a prefill engine's first token: the request goes on
                self._hand_over(link, out, state, now)
            elif state is not None and state.engine == engine:
                began = time.monotonic() if state.trace is not None else now
                progress = state.on_output(out, now)
                if state.trace is not None:
                    state.trace.detokenized(began, time.monotonic())
                self._deliver(out.rid, state, progress, out.timings, now)

    def _hand_over(
        self, link: EngineLink, out: RequestOutput, state: Optional[ClientRequest], now: float
    ) -> None:
        """The first token goes to the client as any token does; the request moves to a decode
        engine (request_flow.py `on_handover`)."""
        progress = NOTHING_TO_SEND
        if state is not None and state.engine == link.index:
            lps = out.logprobs[0] if out.logprobs else None
            progress = state.on_token(out.new_token_ids[0], lps, now)
            self._deliver(out.rid, state, progress, None, now)
        self._flow.on_handover(link, out, progress)

    def _deliver(
        self,
        rid: str,
        state: ClientRequest,
        progress: Progress,
        engine_timings: Optional[RequestTimings],
        now: float,
    ) -> None:
        """Send a request's frames; when it finished here, close it (and abort it in the
        engine if only a stop string ended it)."""
        if progress.finished:
            self._flow.close(rid)
            if progress.abort_in_engine:
                self._engines.send(state.engine, AbortRequest(rid, "stop_string"))
            timings = state.timings(engine_timings, now)
            self._log.info(
                "request_finished", rid=rid, finish_reason=progress.finish_reason,
                num_output_tokens=len(state.token_ids), ttft_s=timings.ttft_s,
                tpot_s=timings.tpot_s, e2e_s=timings.e2e_s, queue_s=timings.queue_s,
                engine=self._engines.name_of(state.engine),
            )  # fmt: skip
            self._latency.record(now, timings.ttft_s, timings.tpot_s)
        for frame in progress.frames:
            if not self._clients.send(state.identity, frame):
                break

    def check_invariants(self) -> None:
        """Read-only; raises AssertionError when the latency window is out of order."""
        self._latency.check_invariants()
