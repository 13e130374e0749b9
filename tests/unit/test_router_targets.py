"""The router's preference for the engine predicted to meet a request's latency targets
(services/tokenizer/router_targets.py), from two engines' reports; what the scheduler's slo
policy reports for it (SloPolicy.route_report), and its TTFT prediction from prompt tokens."""

from __future__ import annotations

import pytest

from services.scheduler.request import Request
from services.scheduler.slo_classes import parse_slo_classes, reported_classes
from services.scheduler.slo_policy import SloPolicy
from services.tokenizer.router import Router, RouterConfig
from services.tokenizer.router_targets import LatencyReport, predicted_ttft_s, request_targets
from shared.protocol.client_channel.messages import LatencyTargets
from shared.protocol.codec import decode, encode
from shared.protocol.engine_channel import EngineReady, SubmitRequest
from shared.protocol.sampling import SamplingParams
from shared.step_cost import StepCostPredictor

INTERACTIVE = LatencyTargets(ttft_ms=2000.0, tpot_ms=50.0)
# engine 0: a long queue (3 s before a prefill starts); engine 1: a short one, fewer requests
SLOW_QUEUE = LatencyReport(
    queue_s=3.0, admission_rate=10.0, decode_step_s=0.02, prefill_tokens_per_s=20_000.0
)
FAST_QUEUE = LatencyReport(
    queue_s=0.2, admission_rate=10.0, decode_step_s=0.02, prefill_tokens_per_s=20_000.0
)


def _router(reports: list[LatencyReport | None], running: list[int]) -> Router:
    router = Router(RouterConfig("least-load"), len(reports))
    for engine, (report, num_running) in enumerate(zip(reports, running, strict=True)):
        router.on_report(engine, waiting=0, running=num_running, kv_usage=0.1, latency=report)
    return router


def test_a_request_with_targets_goes_to_the_engine_predicted_to_meet_them() -> None:
    # least-load alone picks engine 0 (4 requests against 9); its queue misses a 2 s TTFT
    router = _router([SLOW_QUEUE, FAST_QUEUE], running=[4, 9])
    prompt = [1] * 1000
    assert router.choose(prompt, [0, 1]) == 0
    assert router.choose(prompt, [0, 1], targets=INTERACTIVE) == 1
    assert router.choose(prompt, [0, 1], targets=LatencyTargets(ttft_ms=10_000.0)) == 0
    # a TPOT the fast queue's decode step breaks sends it to the other engine
    slow_steps = LatencyReport(0.2, 10.0, 0.08, 20_000.0)
    router = _router([SLOW_QUEUE, slow_steps], running=[9, 4])
    assert router.choose(prompt, [0, 1]) == 1
    assert router.choose(prompt, [0, 1], targets=LatencyTargets(tpot_ms=50.0)) == 0
    router.check_invariants()


def test_requests_sent_since_the_report_count_as_queued_at_the_reported_rate() -> None:
    # least-load alone always picks engine 0 (engine 1 carries 100 requests)
    router = _router([FAST_QUEUE, LatencyReport(1.0, 10.0, 0.02, 20_000.0)], running=[0, 100])
    prompt = [1] * 100
    picks = []
    for _ in range(21):
        engine = router.choose(prompt, [0, 1], targets=INTERACTIVE)
        assert engine is not None
        router.routed(engine, prompt)
        picks.append(engine)
    # engine 0 is predicted in time (0.2 s + n / 10 req/s + 5 ms <= 0.8 x 2 s) for n <= 13
    # sent since its report, engine 1 (1.0 s + n / 10) for n <= 5; then both miss: least-load
    assert picks == [0] * 14 + [1] * 6 + [0]
    load = router.loads[0]
    assert load.num_sent_since_report == 15
    assert predicted_ttft_s(FAST_QUEUE, 15, 100) == pytest.approx(0.2 + 1.5 + 0.005)
    router.on_report(0, waiting=0, running=15, kv_usage=0.1, latency=FAST_QUEUE)
    assert router.loads[0].num_sent_since_report == 0
    assert router.choose(prompt, [0, 1], targets=INTERACTIVE) == 0


def test_falls_back_to_todays_choice_without_targets_reports_or_a_meeting_engine() -> None:
    prompt = [1] * 1000
    router = _router([SLOW_QUEUE, SLOW_QUEUE], running=[4, 9])
    assert router.choose(prompt, [0, 1], targets=INTERACTIVE) == 0  # both miss: least-load
    router = _router([None, None], running=[4, 9])
    assert router.choose(prompt, [0, 1], targets=INTERACTIVE) == 0  # nothing reported
    # an engine reporting nothing yet is not predicted to miss; one predicted to miss is
    router = _router([SLOW_QUEUE, None], running=[4, 9])
    assert router.choose(prompt, [0, 1], targets=INTERACTIVE) == 1
    assert router.choose(prompt, [0], targets=INTERACTIVE) == 0  # the only ready one


def test_the_slo_policy_reports_a_wait_the_router_can_use() -> None:
    predictor = StepCostPredictor()
    policy = SloPolicy(predictor, max_wait=30.0, max_num_seqs=8, chunk_size=512)
    assert policy.route_report([]) == {}  # no fit, no backlog yet: nothing known
    now = 0.0
    for _ in range(40):  # 40 steps 0.1 s apart, each admitting one of a backlog: 10 req/s
        policy.end_step(now, num_admitted=1, num_waiting=5, num_prompt_tokens=300)
        now += 0.1
    report = policy.route_report([])
    assert report["slo_admission_rate"] == pytest.approx(10.0)
    assert report["slo_prefill_tokens_per_s"] == pytest.approx(3000.0)
    assert report["slo_queue_s"] == 0.0  # nothing ahead
    assert "slo_decode_step_s" not in report  # the predictor has no fit yet


def _waiting(prompt_lens: list[int]) -> list[Request]:
    sampling = SamplingParams(max_tokens=8)
    return [
        Request(f"w{i}", [1] * n, n, sampling, 0, i, 0.0, n + 8, frozenset(), ttft_deadline=1.0)
        for i, n in enumerate(prompt_lens)
    ]


def test_a_ttft_is_predicted_from_the_prompt_tokens_ahead_at_the_measured_token_rate() -> None:
    # a backlog drained 3,000 prompt tokens a second (10 requests a second of 300 tokens):
    # three 500-token prompts ahead wait three times longer than three 50-token ones would,
    # where a count of requests over the admission rate would say the same for both
    policy = SloPolicy(StepCostPredictor(), max_wait=30.0, max_num_seqs=8, chunk_size=512)
    for i in range(40):
        policy.end_step(0.1 * i, num_admitted=1, num_waiting=5, num_prompt_tokens=300)
    assert policy.prompt_token_rate() == pytest.approx(3000.0)
    long_ahead = policy.predicted_ttft(100, 2.0, 0.0, _waiting([500, 500, 500]))
    short_ahead = policy.predicted_ttft(100, 2.0, 0.0, _waiting([50, 50, 50]))
    assert long_ahead == pytest.approx(1600 / 3000.0)
    assert short_ahead == pytest.approx(250 / 3000.0)
    # a request with a later deadline does not count as ahead of one with an earlier one
    assert policy.predicted_ttft(100, 0.5, 0.0, _waiting([500, 500])) == pytest.approx(100 / 3000)


def test_a_request_naming_only_a_class_is_routed_by_the_class_the_engines_report() -> None:
    # the engine's table travels in EngineReady; the frontend resolves a request's class with
    # it as the engine does (its own targets over its class's over the default class's)
    classes = parse_slo_classes("interactive:ttft_ms=2000,tpot_ms=50;batch:ttft_ms=30000")
    ready = EngineReady("m", 64, 100, [0], 10, 16, slo_classes=reported_classes(classes),
                        slo_default_class="batch")  # fmt: skip
    heard = decode(encode(ready))
    assert heard == ready

    def submit(**targets: object) -> SubmitRequest:
        return SubmitRequest("r", [1, 2], SamplingParams(max_tokens=4), **targets)  # type: ignore[arg-type]

    table, default = heard.slo_classes, heard.slo_default_class
    assert request_targets(submit(slo_class="interactive"), table, default) == INTERACTIVE
    assert request_targets(submit(), table, default) == LatencyTargets(ttft_ms=30000.0)
    assert request_targets(submit(slo_class="interactive", ttft_ms=500.0), table, default) == (
        LatencyTargets(ttft_ms=500.0, tpot_ms=50.0)
    )
    assert request_targets(submit(slo_class="unknown"), table, default) is None
    assert request_targets(submit(), table, None) is None
    assert request_targets(submit(), {}, None) is None  # an engine reporting no classes
    # routed: the class's 2 s TTFT passes over the engine with the long queue
    router = _router([SLOW_QUEUE, FAST_QUEUE], running=[4, 9])
    targets = request_targets(submit(slo_class="interactive"), table, default)
    assert router.choose([1] * 1000, [0, 1], targets=targets) == 1
