"""`--policy slo` on a real stack with the SIMULATED worker (issue 33): under overload,
requests whose latency targets are reachable are served within them, and one whose target is
out of reach is refused at once, `slo_unattainable` on the client protocol and 429 with
Retry-After over HTTP; a best-effort one is served anyway. Over HTTP a request that names no
class gets its API key's (`--api-key-file`): the same body is refused with one key and served
with another.

The simulated H200 runs Llama-3-8B: a prefill step costs >= 3 ms (the weights are read once), so
a 1 ms TTFT is out of reach once the step-time predictor has fitted (after 64 steps, which the
warm-up request gives it). Rough runtime: 20-40 s, mostly starting the services.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from conveyor.launcher import LocalStack, StackSettings
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig
from services.worker.sim.config import SimConfig
from shared.client import AsyncClient, Client, EngineError
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import free_port, running_stack

pytestmark = pytest.mark.e2e

PROMPT = "The conveyor belt carries parcels"
REACHABLE = {"ttft_ms": 30_000.0, "tpot_ms": 50.0}
# "urgent" cannot be met (a prefill step costs >= 3 ms) and refuses rather than serve late
CLASSES = "urgent:ttft_ms=1,on_slo_miss=reject;bulk:ttft_ms=30000"
KEYS = {"urgent": "sk-urgent", "bulk": "sk-bulk", None: "sk-plain"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    key_file = tmp_path_factory.mktemp("keys") / "api_keys"
    key_file.write_text("".join(f"{key} {cls or ''}\n" for cls, key in KEYS.items()))
    settings = StackSettings(
        worker="sim",
        sim_config=SimConfig(device="h200", model="llama-3-8b"),
        frontend_address=f"tcp://127.0.0.1:{free_port()}",
        gateway=True,
        gateway_config=GatewayConfig(http_port=free_port(), api_key_file=key_file),
        log_dir=tmp_path_factory.mktemp("logs"),
        scheduler_config=SchedulerConfig(
            policy="slo", max_num_seqs=4, max_num_batched_tokens=256, slo_classes=CLASSES
        ),  # fmt: skip
    )
    yield from running_stack(settings)


async def _overload(address: str) -> list:
    """A burst of 24 requests on 4 slots (each ~48 steps): the queue stays long for seconds."""
    async with AsyncClient(address) as c:
        return await asyncio.gather(
            *(c.generate(PROMPT, max_tokens=48, temperature=0.0, **REACHABLE) for _ in range(24))
        )


def test_at_overload_reachable_targets_are_met_and_unreachable_ones_refused(
    stack: LocalStack,
) -> None:
    address = stack.frontend_address
    with Client(address) as c:
        warm = c.generate(PROMPT, max_tokens=80, temperature=0.0)  # 80 steps: the predictor fits
        assert warm.finish_reason == "length"

    async def scenario() -> tuple[list, float, object, object]:
        load = asyncio.create_task(_overload(address))
        await asyncio.sleep(0.5)  # the burst is queued
        async with AsyncClient(address) as c:
            start = time.perf_counter()
            with pytest.raises(EngineError) as refused:
                await c.generate(PROMPT, max_tokens=8, ttft_ms=1.0, on_slo_miss="reject")
            refused_s = time.perf_counter() - start
            late = await c.generate(PROMPT, max_tokens=8, ttft_ms=1.0)  # best-effort: served
            url = f"http://127.0.0.1:{stack.settings.gateway_config.http_port}"
            async with httpx.AsyncClient(timeout=30.0) as http:
                body = {"prompt": PROMPT, "max_tokens": 8, "ttft_ms": 1, "on_slo_miss": "reject"}
                auth = {"Authorization": f"Bearer {KEYS[None]}"}
                reply = await http.post(url + "/v1/completions", json=body, headers=auth)
        return await load, refused_s, (refused.value, late), reply

    served, refused_s, (error, late), reply = asyncio.run(scenario())
    assert error.code == "slo_unattainable", error
    assert refused_s <= SLOW_HOST_MARGIN_S  # decided on arrival: no wait for the queue
    assert late.finish_reason == "length" and len(late.token_ids) == 8
    assert reply.status_code == 429, reply.text
    assert reply.json()["error"]["code"] == "slo_unattainable"
    assert reply.headers["retry-after"] == "1"
    for out in served:  # reachable: every one served within its targets
        assert out.finish_reason == "length" and len(out.token_ids) == 48
        ttft, tpot = out.timings["ttft_s"], out.timings["tpot_s"]
        assert ttft is not None and ttft <= REACHABLE["ttft_ms"] / 1000.0, out.timings
        assert tpot is not None and tpot <= REACHABLE["tpot_ms"] / 1000.0 + SLOW_HOST_MARGIN_S
    with Client(address) as c:
        engine = c.stats()["engine"]
    assert engine["num_slo_refused"] >= 2 and engine["num_slo_best_effort"] >= 1, engine


def test_a_request_naming_no_class_gets_its_api_keys_class(stack: LocalStack) -> None:
    url = f"http://127.0.0.1:{stack.settings.gateway_config.http_port}/v1/completions"
    with Client(stack.frontend_address) as c:  # the predictor has fitted (as the test above)
        c.generate(PROMPT, max_tokens=80, temperature=0.0)
    body = {"prompt": PROMPT, "max_tokens": 4}

    def post(key: str, **extra: object) -> httpx.Response:
        auth = {"Authorization": f"Bearer {key}"}
        return httpx.post(url, json={**body, **extra}, headers=auth, timeout=30.0)

    refused = post(KEYS["urgent"])  # the key's class: unreachable, and it refuses
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "slo_unattainable"
    for served in (post(KEYS["bulk"]), post(KEYS[None]), post(KEYS["urgent"], slo_class="bulk")):
        assert served.status_code == 200, served.text  # the body's own class wins over the key's
        assert served.json()["usage"]["completion_tokens"] == 4
    assert post("sk-unknown").status_code == 401
