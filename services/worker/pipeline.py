"""Step pipelining: a step launched but not finished, and when launching ahead pays.

With pipelining, the worker loop (services/worker/loop.py `PipelinedSteps`) launches step N+1
before it finishes step N: N+1's decodes of the sequences that sampled at step N read those
tokens from step N's device tensor by index (`device_rows`), so building and launching N+1
never waits for N's tokens on the host. Until they land, each such sequence's history ends
with the held batch's PENDING_TOKEN (services/worker/held_batch.py).

When it pays (`pipelines_steps` in services/worker/config.py, then `OverlapRule`):
* only where the device runs behind the host. On CUDA the host queues kernels and goes on; on
  a CPU the launch is the compute itself, so launching ahead would only hold each result back
  by a step. With tensor parallelism rank 0 shares each step's tokens from the host, so there
  is nothing to launch ahead either. So: on for a CUDA device and one rank, else off;
* and there, only while what it hides is worth it: the host's work to get a step onto the
  device (apply the plan, build the inputs, queue the forward), which without pipelining the
  device waits for. The worker measures that work and the device's forward time on every step
  (CUDA events, `DeviceClock`) and keeps launching ahead while the first is at least 2% of the
  second (the house's bar for an optimisation), averaged over ~32 steps; it stops below 1%
  (so it does not flip at the edge) and starts again at 2%. Long steps (large prefills, big
  models) thus answer at once; short decode steps overlap.
The internal setting `pipeline_steps` ("on"/"off") forces either way (tests force "on" on the
CPU to check the tokens are the same).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from services.worker.held_batch import PENDING_TOKEN, ExpandedStep, HeldBatch, HeldSeq
from shared.protocol.worker_channel import TokenLogprobs


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """One step whose forward and sampling are queued (ModelRunner.launch): a record the runner
    writes (ModelRunner.finish lands its tokens); the loop reads only `step_id` and
    `device_done`."""

    step: ExpandedStep
    sampled: list[HeldSeq]  # [S] the sequences that sample, in batch order
    positions: list[int]  # [S] where each one's pending token sits ([] when landed at launch)
    start: float  # perf_counter() when the launch began
    device_tokens: Optional[torch.Tensor]  # [S] int64 on the device; None: sampled on the host
    host_tokens: torch.Tensor  # [S] int64 on the CPU (pinned on CUDA; the copy is queued)
    ready: Optional[Any]  # torch.cuda.Event recorded after that copy; None: nothing to wait for
    logprobs: list[Optional[TokenLogprobs]]  # [S]
    token_ids: Optional[list[int]] = None  # [S] once landed (written into the histories)
    error: Optional[BaseException] = None  # why landing failed (raised again on every try)
    marks: tuple[Optional[Any], Optional[Any]] = (None, None)  # DeviceClock's forward events
    queued_s: float = 0.0  # host seconds from `start` until the forward was queued

    @property
    def step_id(self) -> int:
        return self.step.step_id

    @property
    def landed(self) -> bool:
        return self.token_ids is not None

    def device_done(self) -> bool:
        """Whether landing would not wait (the device has finished the step and its copy)."""
        return self.ready is None or bool(self.ready.query())


def known_step(
    step: ExpandedStep,
    sampled: list[HeldSeq],
    token_ids: list[int],
    logprobs: list[Optional[TokenLogprobs]],
    start: float,
    marks: tuple[Optional[Any], Optional[Any]],
    queued_s: float,
) -> LaunchedStep:
    """A launched step whose tokens are already in the histories (none, or sampled on the
    host): landed, with no placeholder to fill (`positions` empty)."""
    host = torch.tensor(token_ids, dtype=torch.int64)
    return LaunchedStep(step, sampled, [], start, None, host, None, logprobs,
                        token_ids=token_ids, marks=marks, queued_s=queued_s)  # fmt: skip


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


def wait_for_tokens(launched: LaunchedStep) -> list[int]:
    """A launched step's tokens [S] on the host, waiting for the device; a failure is kept in
    the record and raised on every later call (the step cannot be landed any more)."""
    if launched.error is not None:
        raise launched.error
    try:
        if launched.ready is not None:
            launched.ready.synchronize()
        return launched.host_tokens.tolist()
    except BaseException as exc:
        launched.error = exc
        raise


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


def check_pending(held: HeldBatch, in_flight: Sequence[LaunchedStep]) -> None:
    """Raise AssertionError unless the placeholders in the held histories are exactly the
    samples of the launched steps not yet landed (`in_flight`: what the loop still holds);
    reads only. A batch that needs a reset may keep those of a step that failed to land."""
    expected: set[tuple[int, int]] = set()
    for launched in in_flight:
        if launched.landed:
            continue
        for seq, pos in zip(launched.sampled, launched.positions, strict=True):
            assert seq.token_ids[pos] == PENDING_TOKEN, (launched.step_id, seq.rid, pos)
            expected.add((id(seq), pos))
    if held.needs_reset:
        return
    for seq in held.seqs.values():
        for pos, tok in enumerate(seq.token_ids):
            assert tok != PENDING_TOKEN or (id(seq), pos) in expected, (seq.rid, pos)


class OverlapRule:
    """Whether the loop launches step N+1 before finishing step N (see the module docstring):
    `forced` (pipeline_steps "on"), else while the host's work to queue a step is at least
    ON_SHARE of the device's forward time, averaged with weight WEIGHT per step; it stops below
    OFF_SHARE. Until a first measure (and on the CPU, where there is none) it overlaps."""

    ON_SHARE = 0.02
    OFF_SHARE = 0.01
    WEIGHT = 1.0 / 32

    def __init__(self, forced: bool) -> None:
        self.forced = forced
        self.share: Optional[float] = None  # the running average of queued_s / forward_s
        self._on = True

    def on_step(self, queued_s: float, forward_s: Optional[float]) -> None:
        """Called once per finished step with its measures (forward_s None: not measured)."""
        if forward_s is None or forward_s <= 0.0:
            return
        x = queued_s / forward_s
        self.share = x if self.share is None else self.share + self.WEIGHT * (x - self.share)
        if self._on and self.share < self.OFF_SHARE:
            self._on = False
        elif not self._on and self.share >= self.ON_SHARE:
            self._on = True

    def overlaps(self) -> bool:
        return self.forced or self._on


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

    def on_step(self, start: Optional[Any], end: Optional[Any]) -> Optional[float]:
        """Called in step order once a step's tokens are on the host (both events done);
        returns the step's forward seconds on the device (None on the CPU)."""
        if start is None or end is None:
            return None
        if self._last_end is not None:
            gap = self._last_end.elapsed_time(start) / 1000.0
            self.idle_s += gap
            self._gaps.append(gap)
        busy = start.elapsed_time(end) / 1000.0
        self.busy_s += busy
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
        return busy
