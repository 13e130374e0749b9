"""One benchmark run: send a workload on its arrival schedule through a backend, collect traces.

Warm-up requests go first, one at a time, and are not counted; the measured window starts after
them. Arrivals follow the schedule regardless of completions; max concurrency then holds a request
back until a slot frees, and its latency counts from when it is actually sent (as in vLLM).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Optional

from conveyor.bench.arrivals import ArrivalConfig, arrival_offsets
from conveyor.bench.backends import Backend, SamplingChoice
from conveyor.bench.metrics import RequestTrace
from conveyor.bench.report import ProgressBar
from conveyor.bench.workloads import BenchRequest


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """Traces in workload order; the measured window in wall-clock time (time.time())."""

    traces: list[RequestTrace]
    start_wall: float
    end_wall: float
    duration_s: float  # first send to last completion (perf_counter)
    num_warmup_failures: int = 0


async def run_workload(
    backend: Backend,
    requests: list[BenchRequest],
    arrivals: ArrivalConfig,
    sampling: SamplingChoice,
    progress: Optional[ProgressBar] = None,
) -> RunOutcome:
    """Runs warm-ups, then the measured workload; returns when every request has finished."""
    if not requests:
        raise ValueError("the workload has no requests")
    warmup_failures = 0
    for i in range(arrivals.num_warmups):
        trace = await backend.send(requests[i % len(requests)], sampling)
        warmup_failures += 0 if trace.success else 1
    offsets = arrival_offsets(arrivals, len(requests))
    limit = asyncio.Semaphore(arrivals.max_concurrency or len(requests))

    async def one(req: BenchRequest) -> RequestTrace:
        async with limit:
            trace = await backend.send(req, sampling)
        if progress is not None:
            progress.advance(trace.success)
        return trace

    start_wall = time.time()
    start = time.perf_counter()
    tasks: list[asyncio.Task[RequestTrace]] = []
    for req, offset in zip(requests, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    traces = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return RunOutcome(
        traces=traces,
        start_wall=start_wall,
        end_wall=time.time(),
        duration_s=max(duration, 1e-9),
        num_warmup_failures=warmup_failures,
    )
