"""The gateway's Prometheus output: names, types and values (no engine needed). Runtime: <1 s."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.events import ChoiceEnd, RequestTimes
from services.gateway.metrics import GatewayMetrics

# The shape of a protocol `stats` reply, with the scheduler's own key names.
STATS_REPLY = {
    "type": "stats",
    "v": 1,
    "ready": True,
    "frontend": {"requests_in_flight": 2, "requests_total": 40},
    "engine": {
        "num_waiting": 3,
        "num_running": 5,
        "kv_blocks_used": 30,
        "kv_blocks_total": 120,
        "kv_usage": 0.25,
        "num_preemptions": 7,
        "num_steps": 900,
        "batch_utilization": 0.5,
        "spec_decode_num_drafts": 4,
        "spec_decode_num_draft_tokens": 12,
        "spec_decode_num_accepted_tokens": 5,
        "spec_decode_num_accepted_tokens_pos_0": 3,
        "spec_decode_num_accepted_tokens_pos_1": 2,
    },
}


def families(registry: CollectorRegistry) -> dict[str, tuple[str, dict[str, float]]]:
    """family name -> (type, {sample name with labels: value})."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        samples = {}
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        out[fam.name] = (fam.type, samples)
    return out


def test_engine_stats_become_vllm_named_gauges_and_counters() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    assert "conveyor:num_requests_running" not in families(registry)  # no stats yet: no guess
    metrics.engine.update(STATS_REPLY)
    fams = families(registry)
    e0 = "{engine=0}"  # a reply without `engines`: one engine, "0"
    assert fams["conveyor:num_requests_running"] == (
        "gauge",
        {"conveyor:num_requests_running" + e0: 5},
    )
    assert fams["conveyor:num_requests_waiting"][1] == {"conveyor:num_requests_waiting" + e0: 3}
    assert fams["conveyor:kv_cache_usage_perc"][1] == {"conveyor:kv_cache_usage_perc" + e0: 0.25}
    assert fams["conveyor:kv_cache_blocks_total"][1] == {"conveyor:kv_cache_blocks_total" + e0: 120}
    assert fams["conveyor:num_preemptions"] == (
        "counter",
        {"conveyor:num_preemptions_total" + e0: 7},
    )
    assert fams["conveyor:engine_num_steps"][0] == "counter"  # other num_* stats are counters
    assert fams["conveyor:frontend_requests_in_flight"][0] == "gauge"
    assert fams["conveyor:frontend_requests"][0] == "counter"  # *_total
    assert fams["conveyor:engine_ready"][1] == {"conveyor:engine_ready": 1.0}
    assert fams["conveyor:spec_decode_num_draft_tokens"] == (
        "counter",
        {"conveyor:spec_decode_num_draft_tokens_total" + e0: 12},
    )
    assert fams["conveyor:spec_decode_num_accepted_tokens_per_pos"] == (
        "counter",
        {
            "conveyor:spec_decode_num_accepted_tokens_per_pos_total{engine=0,position=0}": 3,
            "conveyor:spec_decode_num_accepted_tokens_per_pos_total{engine=0,position=1}": 2,
        },
    )


def test_a_finished_choice_moves_counters_and_histograms() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    times = RequestTimes(queue_s=0.01, ttft_s=0.2, tpot_s=0.05, e2e_s=1.0)
    metrics.observe_end(ChoiceEnd(0, "length", 11, 17, times))
    metrics.observe_end(ChoiceEnd(1, "stop", 11, 3, RequestTimes(ttft_s=0.3)))
    metrics.observe_aborted(2)
    fams = families(registry)
    assert fams["conveyor:prompt_tokens"][1]["conveyor:prompt_tokens_total"] == 22
    assert fams["conveyor:generation_tokens"][1]["conveyor:generation_tokens_total"] == 20
    success = fams["conveyor:request_success"][1]
    assert success["conveyor:request_success_total{finished_reason=length}"] == 1
    assert success["conveyor:request_success_total{finished_reason=abort}"] == 2
    ttft = fams["conveyor:time_to_first_token_seconds"][1]
    assert ttft["conveyor:time_to_first_token_seconds_count"] == 2
    assert abs(ttft["conveyor:time_to_first_token_seconds_sum"] - 0.5) < 1e-9
    # A timing the engine did not report is not observed as zero.
    e2e = fams["conveyor:e2e_request_latency_seconds"][1]
    assert e2e["conveyor:e2e_request_latency_seconds_count"] == 1


def test_two_gateways_do_not_share_a_registry() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    GatewayMetrics(a).observe_aborted(1)
    GatewayMetrics(b)
    assert (
        "conveyor:request_success_total{finished_reason=abort}"
        not in families(b).get("conveyor:request_success", ("", {}))[1]
    )


def test_each_engine_is_labelled() -> None:
    """Data parallelism: the reply's `engines` map becomes one series per engine; an engine
    that did not answer (nil) has none."""
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    engine = STATS_REPLY["engine"]
    other = {**engine, "num_running": 1, "kv_usage": 0.75}  # type: ignore[dict-item]
    metrics.engine.update({**STATS_REPLY, "engines": {"0": engine, "1": other, "2": None}})
    fams = families(registry)
    assert fams["conveyor:num_requests_running"][1] == {
        "conveyor:num_requests_running{engine=0}": 5,
        "conveyor:num_requests_running{engine=1}": 1,
    }
    assert fams["conveyor:kv_cache_usage_perc"][1]["conveyor:kv_cache_usage_perc{engine=1}"] == 0.75
    assert fams["conveyor:engine_num_steps"][1] == {
        "conveyor:engine_num_steps_total{engine=0}": 900,
        "conveyor:engine_num_steps_total{engine=1}": 900,
    }
