"""Steady runs (services/scheduler/steady.py, the seam `SteadyDecodes`): while the batch is
unchanged the scheduler reuses the last step's decodes, checks only the requests due at a block
boundary or their last token, and `update` appends a result's tokens without per-request checks
while none can end a request.

Long runs of decodes against the checking worker (it reads every context through the block
tables, so a table that did not grow in time, or a block used twice, fails), with two plans in
flight or one, arrivals and aborts that break a run mid-way, end-of-sequence tokens, and a pool
small enough to preempt at a block boundary. After every call: integrity; at the end: every
request's tokens are the model's, its length limit holds, no block leaked; and the steady paths
did run (else the test would prove nothing).
"""

from __future__ import annotations

from collections import deque

import pytest
from test_scheduler_properties import EOS, VOCAB, Arrival, _check_final
from test_scheduler_support import CheckingWorker, FakeClock, Run, arrive

from services.scheduler import Scheduler, SchedulerConfig
from shared.protocol.worker_channel import StepResult


def _workload() -> list[Arrival]:
    """Eight requests at once (mostly ignoring end-of-sequence, different lengths, so runs end
    at different steps), one joining later and one aborted mid-run."""
    first = [
        Arrival(0, 3 + i, 30 + 13 * i, 0, i != 3, 70 if i == 5 else None, i == 5) for i in range(8)
    ]
    return [*first, Arrival(40, 9, 25, 0, True, None, False)]


def _run(
    sched: Scheduler, worker: CheckingWorker, workload: list[Arrival], phases: list[bool]
) -> tuple[Run, dict[str, Arrival]]:
    """Each round: arrivals, plans (a second one in flight when the phase says so), aborts
    while plans are in flight, one result delivered; invariants after every call."""
    run, admitted = Run(), {}
    results: deque[StepResult] = deque()
    for step in range(2000):
        admitted.update(arrive(sched, workload, step, False, run))
        while sched.can_schedule() and (phases[step % len(phases)] or not results):
            plan = sched.schedule()
            sched.check_invariants()
            if plan is None:
                break
            results.append(worker.execute(plan))
            arrive(sched, workload, step, True, run)
        if results:
            run.add(sched.update(results.popleft()))
            sched.check_invariants()
        elif step > max(a.step for a in workload) and not sched.has_work():
            break
    return run, admitted


@pytest.mark.parametrize("phases", [[True], [True, False, False], [False]])
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("num_blocks", [400, 60])  # 60: preemption at block boundaries
def test_steady_runs_keep_tables_tokens_and_lengths_exact(
    phases: list[bool], caching: bool, num_blocks: int
) -> None:
    block_size, max_model_len = 4, 160
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=40, chunk_size=16, async_scheduling=True,
        enable_prefix_caching=caching,
    )  # fmt: skip
    clock = FakeClock()
    sched = Scheduler(config, num_blocks, block_size, max_model_len, [EOS], clock=clock)
    worker = CheckingWorker(num_blocks, block_size, vocab_size=VOCAB, max_model_len=max_model_len)
    workload = _workload()
    run, admitted = _run(sched, worker, workload, phases)
    assert not sched.has_work() and sched.pool.num_used == 0
    assert set(admitted) == {f"r{i}" for i in range(len(workload))}
    for rid, a in admitted.items():
        _check_final(run, rid, a, min(max_model_len, num_blocks * block_size + 1))
    # the steady seam's own counts: steps whose decodes a run filled, results appended in C
    seen = (sched.steady.num_reused_steps, sched.steady.num_fast_results)
    assert seen[0] > 50 and seen[1] > 20, seen
    if num_blocks == 60:
        assert sched.stats()["num_preemptions"] > 0
