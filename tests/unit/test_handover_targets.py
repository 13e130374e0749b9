"""A handed-over request keeps its latency targets on the decode engine (issue 32): the decode
scheduler decides them on arrival (a hand-over is a resumption: never refused, even when the
targets are out of reach) and admits the request with them once its KV pull ends, whether
the pull succeeded, failed, or was cut off by a lost worker. Scheduler core, injected clock,
`--policy slo`, `check_invariants()` after every step (test_scheduler_slo.timed_step).
"""

from __future__ import annotations

import dataclasses

from test_scheduler_slo import timed_step
from test_scheduler_support import Run, make, submit

from services.scheduler.scheduler import Scheduler
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.errors import ErrorCode
from shared.protocol.kv_channel import KvHandover
from shared.protocol.worker_channel import KvPulled, PullKv

PROMPT_LEN, MAX_TOKENS, BS = 41, 6, 4
SOURCE = KvHandover(lease_id=7, generation=99, block_ids=list(range(10)), num_tokens=40,
                    block_size=BS, kv_endpoint="ipc://prefill-kv")  # fmt: skip


def handed_over(**targets: object) -> SubmitRequest:
    """The decode engine's submit of a request whose first token the prefill engine made."""
    first = dataclasses.replace(submit("r", PROMPT_LEN, MAX_TOKENS), **targets)
    return dataclasses.replace(first, output_token_ids=[5], attempt=1, kv_source=SOURCE)


def pulling(**targets: object) -> tuple[Scheduler, float]:
    """A decode scheduler (slo policy) whose pull of `r` has started, and when it arrived."""
    sched, _, clock = make(policy="slo")
    assert sched.add_request(handed_over(**targets)) is None
    (pull,) = sched.take_worker_messages()
    assert isinstance(pull, PullKv) and not sched.has_work()
    clock.advance(0.5)  # the pull takes a while: the deadline stays the one set on arrival
    return sched, clock.now - 0.5


def test_the_targets_survive_a_pull() -> None:
    sched, arrived = pulling(ttft_ms=2000.0, tpot_ms=50.0, slo_class="interactive")
    sched.pull_done(KvPulled("r", True, 4096, 0.001))
    req = sched.live.get("r")
    assert req is not None and req.tpot_s == 0.05 and not req.best_effort
    assert req.ttft_deadline == arrived + 2.0


def test_a_failed_pull_recomputes_with_its_targets() -> None:
    sched, _ = pulling(tpot_ms=80.0)
    sched.pull_done(KvPulled("r", False, code="timeout"))
    req = sched.live.get("r")
    assert req is not None and req.tpot_s == 0.08


def test_a_worker_lost_mid_pull_keeps_the_targets() -> None:
    sched, _ = pulling(tpot_ms=120.0)
    sched.requeue_all(max_retries=3, code="worker_lost", message="the worker died")
    req = sched.live.get("r")
    assert req is not None and req.tpot_s == 0.12


def test_an_unreachable_target_is_served_best_effort_never_refused() -> None:
    # once the step-time predictor has fitted, a 1 ms TPOT with on_slo_miss=reject refuses a
    # new request (test_scheduler_slo.py); a hand-over with the same targets goes on, marked
    sched, worker, clock = make(policy="slo", num_blocks=256)
    run = Run()
    for i in range(200):
        if i % 8 == 0:
            sched.add_request(submit(f"w{i}", 24, 12))
        timed_step(sched, worker, clock, run)
    assert sched.predictor.num_fits
    tight = {"tpot_ms": 1.0, "on_slo_miss": "reject"}
    refused = sched.add_request(dataclasses.replace(submit("n", 8, 4), **tight))
    assert refused is not None and refused.code == ErrorCode.SLO_UNATTAINABLE
    assert sched.add_request(handed_over(**tight)) is None
    sched.take_worker_messages()
    sched.pull_done(KvPulled("r", False, code="timeout"))  # recomputes: no KV in the checker
    req = sched.live.get("r")
    assert req is not None and req.tpot_s == 0.001 and req.best_effort
    while sched.has_work():
        timed_step(sched, worker, clock, run)
    assert len(run.tokens("r")) == MAX_TOKENS - 1
