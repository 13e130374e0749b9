"""Which prefill engine hands over to which decode engine, decided by the frontend at start from
their EngineReady (services/tokenizer/pairing.py, engines.py): engines of one model pair
whatever their tensor-parallel sizes (the KV is re-sharded, logged as such); a pairing that
cannot hand over is logged as an error when its second engine becomes ready, and the router
sends no hand-over along it. Real `Engines` over unconnected links (nothing is sent)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import structlog
import zmq
from structlog.testing import capture_logs

from services.tokenizer.config import FrontendConfig
from services.tokenizer.engines import Engines
from services.tokenizer.pairing import pairing_fields, pairing_problem
from shared.protocol.engine_channel import EngineReady, SubmitRequest
from shared.protocol.kv_channel import KvHandover
from shared.protocol.sampling import SamplingParams

READY = EngineReady("tiny", 256, 32, [0], 64, 16, role="decode")
PREFILL_TP2 = dataclasses.replace(
    READY, role="prefill", kv_endpoint="ipc://a ipc://a-r1", tensor_parallel_size=2
)
PREFILL_OTHER = dataclasses.replace(PREFILL_TP2, model_name="other", kv_endpoint="ipc://b")


@pytest.fixture
def engines() -> Iterator[Engines]:
    context = zmq.Context()
    addresses = tuple(f"ipc:///tmp/pairing-{i}.sock" for i in range(4))
    config = FrontendConfig(scheduler_addresses=addresses)
    out = Engines(config, context, structlog.get_logger(), lambda _: None, "fe-test")
    yield out
    out.close()
    context.term()


def test_engines_of_one_model_pair_whatever_their_sizes() -> None:
    decode_tp1 = dataclasses.replace(READY, tensor_parallel_size=1)
    assert pairing_fields(PREFILL_TP2, decode_tp1)["resharded"] is True
    assert pairing_fields(PREFILL_TP2, READY)["resharded"] is None  # a size not reported
    assert pairing_problem(PREFILL_TP2, decode_tp1) is None
    assert "models" in (pairing_problem(PREFILL_OTHER, decode_tp1) or "")
    other_blocks = dataclasses.replace(READY, block_size=32)
    assert "block sizes" in (pairing_problem(PREFILL_TP2, other_blocks) or "")
    no_cache = dataclasses.replace(READY, prefix_caching=False)
    assert "prefix cache" in (pairing_problem(PREFILL_TP2, no_cache) or "")


def test_an_unpaired_engine_is_logged_at_start_and_gets_no_hand_over(engines: Engines) -> None:
    links = engines.links
    with capture_logs() as logs:
        engines.on_ready(links[0], PREFILL_TP2)
        engines.on_ready(links[1], PREFILL_OTHER)
        engines.on_ready(links[2], dataclasses.replace(READY, tensor_parallel_size=1))
    pairings = [e for e in logs if e["event"].startswith("handover_pairing")]
    assert [(e["event"], e["prefill"], e["decode"]) for e in pairings] == [
        ("handover_pairing", "0", "2"), ("handover_pairing_refused", "1", "2")
    ]  # fmt: skip
    assert (pairings[0]["prefill_tp"], pairings[0]["decode_tp"], pairings[0]["resharded"]) == (
        2, 1, True
    )  # fmt: skip
    new = SubmitRequest("r", [1, 2, 3], SamplingParams())
    assert engines.by_role([0, 1, 2], new) == ([0], dataclasses.replace(new, hand_over=True))
    ref = KvHandover(1, 2, [0], 16, 16, kv_endpoint=PREFILL_OTHER.kv_endpoint)
    handed = dataclasses.replace(new, output_token_ids=[5], kv_source=ref)
    # engine 1's hand-over (it was routed before engine 2 was ready): nobody pulls it
    assert engines.by_role([0, 1, 2], handed) == ([2], dataclasses.replace(handed, kv_source=None))
    ref0 = dataclasses.replace(ref, kv_endpoint=PREFILL_TP2.kv_endpoint)
    from_0 = dataclasses.replace(handed, kv_source=ref0)
    assert engines.by_role([0, 1, 2], from_0) == ([2], from_0)
    # a decode engine with no prefix cache takes no hand-over: the prompt is served colocated
    engines.on_ready(links[3], dataclasses.replace(READY, prefix_caching=False))
    assert engines.by_role([0, 1, 3], new) == ([0, 1, 3], new)
