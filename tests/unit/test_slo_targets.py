"""Latency targets on the request (issue 33): the client channel checks them, the engine's
classes parse and validate, and a request's own targets win over its class's."""

from __future__ import annotations

import msgpack
import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.slo_classes import SloTargets, parse_slo_classes, resolve_targets
from shared.protocol.client_channel import ClientMessageError, decode_client_message
from shared.protocol.codec import DecodeError, decode, encode
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.errors import ErrorCode
from shared.protocol.sampling import SamplingParams


def _generate(**fields: object) -> bytes:
    return msgpack.packb({"type": "generate", "v": 1, "id": "r", "prompt": "hi", **fields})


def test_the_client_channel_carries_targets_and_refuses_bad_ones() -> None:
    cmd = decode_client_message(_generate(ttft_ms=2000, tpot_ms=50.5, on_slo_miss="reject"))
    assert (cmd.targets.ttft_ms, cmd.targets.tpot_ms, cmd.targets.on_slo_miss) == (
        2000.0, 50.5, "reject")  # fmt: skip
    assert decode_client_message(_generate()).targets.ttft_ms is None
    for bad in ({"ttft_ms": 0}, {"tpot_ms": -1.0}, {"ttft_ms": "1"}, {"on_slo_miss": "drop"},
                {"ttft_ms": float("nan")}):  # fmt: skip
        with pytest.raises(ClientMessageError) as e:
            decode_client_message(_generate(**bad))
        assert e.value.code == "invalid_params", bad
    with pytest.raises(ClientMessageError):
        decode_client_message(_generate(slo_class=""))


def test_classes_parse_validate_and_resolve() -> None:
    classes = parse_slo_classes("fast:ttft_ms=100,tpot_ms=20,on_slo_miss=reject; slow:ttft_ms=9")
    assert classes["fast"] == SloTargets(100.0, 20.0, "reject")
    assert classes["slow"] == SloTargets(9.0, None, "best_effort")
    for bad in ("x", "x:ttft_ms=a", "x:tpot_ms=-1", "x:on_slo_miss=no", "x:y=1", "a:;a:"):
        with pytest.raises(ValueError):
            parse_slo_classes(bad)
    with pytest.raises(ValueError, match="slo_default_class"):
        SchedulerConfig(slo_default_class="nope")

    def submit(**kw: object) -> SubmitRequest:
        return SubmitRequest("r", [1], SamplingParams(), **kw)  # type: ignore[arg-type]

    assert resolve_targets(submit(slo_class="fast", tpot_ms=30.0), classes, None) == SloTargets(
        100.0, 30.0, "reject")  # fmt: skip
    assert resolve_targets(submit(), classes, "slow") == classes["slow"]
    assert resolve_targets(submit(), classes, None) == SloTargets()
    assert resolve_targets(submit(slo_class="other"), classes, None) is None


def test_the_engine_channel_drops_a_submit_with_bad_targets_where_it_is_decoded() -> None:
    """A SubmitRequest frame on the scheduler's socket with a target no class could hold is an
    invalid_field drop at decode, not an error in the scheduler's handler (found by the
    internal fuzz test: `ttft_ms` 0 reached `resolve_targets` and raised there)."""
    good = SubmitRequest("r", [1, 2], SamplingParams(max_tokens=2), ttft_ms=100.0)
    assert decode(encode(good)) == good
    for bad in ({"ttft_ms": 0.0}, {"tpot_ms": -1.0}, {"ttft_ms": float("nan")},
                {"on_slo_miss": "later"}):  # fmt: skip
        wire = msgpack.unpackb(encode(good))
        wire.update(bad)
        with pytest.raises(DecodeError) as err:
            decode(msgpack.packb(wire))
        assert err.value.code == ErrorCode.INVALID_FIELD, bad
