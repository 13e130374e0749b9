"""A step launched but not finished: its sampled tokens on the device, on their way to the host.

With `pipeline_steps` on, the worker loop (services/worker/loop.py) launches step N+1 before it
finishes step N: N+1's decodes of the sequences that sampled at step N read those tokens from
step N's device tensor by index (`device_rows`), so building and launching N+1 never waits for
N's tokens on the host. Until they land, each such sequence's history ends with
`PENDING_TOKEN`: its length is right (the persistent batch checks plan N+1 against it; the
sequence's output index, which seeds its draws, counts it), its value is never read on the host
(the input builder overwrites it on the device; `land` writes the real token over it before
anything that reads histories on the host — penalties — runs). A value far outside any
vocabulary (not -1, which tensor indexing would wrap to the last row), so that a slip fails the
embedding lookup loudly instead of computing a wrong token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from services.worker.held_batch import ExpandedStep, HeldSeq
from shared.protocol.worker_channel import TokenLogprobs

PENDING_TOKEN = 1 << 62  # a sampled token still only on the device (see the module docstring)


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """One step whose forward and sampling are queued (ModelRunner.launch); `land` brings its
    tokens to the host, ModelRunner.finish turns it into the StepResult."""

    step: ExpandedStep
    sampled: list[HeldSeq]  # [S] the sequences that sample, in batch order
    positions: list[int]  # [S] where each one's token sits in its history
    start: float  # perf_counter() when the launch began
    device_tokens: Optional[torch.Tensor]  # [S] int64 on the device; None: sampled on the host
    host_tokens: torch.Tensor  # [S] int64 on the CPU (pinned on CUDA; the copy is queued)
    ready: Optional[Any]  # torch.cuda.Event recorded after that copy; None: nothing to wait for
    logprobs: list[Optional[TokenLogprobs]]  # [S]
    token_ids: Optional[list[int]] = None  # [S] once landed
    error: Optional[BaseException] = None  # why landing failed (raised again on every try)
    marks: tuple[Optional[Any], Optional[Any]] = (None, None)  # DeviceClock's forward events

    @property
    def step_id(self) -> int:
        return self.step.step_id

    def device_done(self) -> bool:
        """Whether `land` would not wait (the device has finished the step and its copy)."""
        return self.ready is None or bool(self.ready.query())


def copy_to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, Optional[Any]]:
    """Queue tokens [S] for the host: on CUDA a non-blocking copy into pinned memory and an
    event after it (no sync here); on the CPU the tensor itself."""
    if tokens.device.type == "cpu":
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def land(launched: LaunchedStep) -> list[int]:
    """Wait for a launched step's tokens on the host and write them into the histories in
    place of their PENDING_TOKEN. Idempotent; a failure is kept and raised on every call."""
    if launched.error is not None:
        raise launched.error
    if launched.token_ids is None:
        try:
            if launched.ready is not None:
                launched.ready.synchronize()
            tokens = launched.host_tokens.tolist()
        except BaseException as exc:
            launched.error = exc
            raise
        for seq, pos, tok in zip(launched.sampled, launched.positions, tokens, strict=True):
            seq.token_ids[pos] = tok
        launched.token_ids = tokens
    return launched.token_ids


def device_rows(step: ExpandedStep, prev: LaunchedStep) -> tuple[list[int], list[int]]:
    """(flat rows of `step`'s input ids, indices into `prev`'s tokens) for every token `step`
    computes that `prev` sampled and has not landed: the decode of each sequence that sampled
    at `prev` and computes now. Sequences joined since (a new or resumed one, a reset) hold
    their tokens from the plan and match nothing."""
    where = {id(seq): i for i, seq in enumerate(prev.sampled)}
    rows: list[int] = []
    src: list[int] = []
    offset = 0
    for seq, start, n in zip(step.seqs, step.start_positions, step.num_tokens, strict=True):
        i = where.get(id(seq))
        if i is not None and start <= prev.positions[i] < start + n:
            rows.append(offset + prev.positions[i] - start)
            src.append(i)
        offset += n
    return rows, src


class DeviceClock:
    """On CUDA, how long the device sat idle between consecutive forward passes (what
    pipelining is for), from timing events around each step's forward: the idle time before
    step N+1 is from step N's end event to step N+1's start event (an event queued behind
    running work fires when that work ends, so a step queued in time shows no gap). Sampling
    and the token copy fall in the gap. Logged as `device_time` every LOG_EVERY steps with
    cumulative totals and wall-clock `t`, so a reader can take the difference over a window
    (bench/gpu/e2e_serve.py). Nothing on the CPU, where the forward is the host's own work."""

    LOG_EVERY = 32

    def __init__(self, device: str, log: Any) -> None:
        self.enabled = device.startswith("cuda")
        self._log = log
        self._last_end: Optional[Any] = None
        self.num_steps = 0
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._gaps: list[float] = []  # since the last log line

    def mark(self) -> Optional[Any]:
        """A timing event recorded now on the current stream (None on the CPU)."""
        if not self.enabled:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def on_step(self, start: Optional[Any], end: Optional[Any]) -> None:
        """Called in step order once a step's tokens are on the host (both events done)."""
        if start is None or end is None:
            return
        if self._last_end is not None:
            gap = self._last_end.elapsed_time(start) / 1000.0
            self.idle_s += gap
            self._gaps.append(gap)
        self.busy_s += start.elapsed_time(end) / 1000.0
        self._last_end = end
        self.num_steps += 1
        if self.num_steps % self.LOG_EVERY == 0 and self._gaps:
            gaps = sorted(self._gaps)
            self._log.info(
                "device_time", t=time.time(), num_steps=self.num_steps,
                busy_s=round(self.busy_s, 6), idle_s=round(self.idle_s, 6),
                idle_p50_us=round(gaps[len(gaps) // 2] * 1e6, 1),
            )  # fmt: skip
            self._gaps = []
