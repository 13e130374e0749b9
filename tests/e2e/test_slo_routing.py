"""The router's preference across two real engines under `--policy slo` (issue 33): a request
with latency targets goes to the engine predicted to meet them, also when it names only a class
(the engines report their class table in EngineReady), while one without targets is routed by
the usual rule.

Two engines of the SIMULATED H200 (Llama-3-8B, 4 slots each) behind one frontend, cache-aware
routing (a prompt's prefix keeps it on one engine; `--router-balance-abs` 64 so that a burst of
one prompt all goes there): a burst of 32 requests of one prompt queues on one engine (8 rounds
of 160 decode steps: seconds), whose report then predicts a queue far past the `tight` class's
300 ms TTFT, while the other engine is idle (it reports no wait). Rough runtime: 15-30 s, mostly
starting the services.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conveyor.launcher import LocalStack
from services.scheduler.config import SchedulerConfig
from services.tokenizer.config import FrontendConfig
from services.tokenizer.router import RouterConfig
from shared.client import AsyncClient
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import running_stack
from tests.e2e.test_data_parallel import dp_settings, engine_of_client_ids

pytestmark = pytest.mark.e2e

# ~120 tokens: its 16-token blocks keep it on one engine (cache-aware); the loaded engine
# computes only each copy's uncached tail, so its measured prompt tokens per second are few
PROMPT = " ".join(["The conveyor belt carries parcels from the dock to the sorting hall."] * 8)
CLASSES = "tight:ttft_ms=300"
HEARTBEAT_S = 1.0  # a frontend hears each engine's report once per hello (services/tokenizer)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    settings = dp_settings(
        tmp_path_factory.mktemp("slo-routing-logs"),
        frontend_config=FrontendConfig(router=RouterConfig(balance_abs=64)),
        scheduler_config=SchedulerConfig(policy="slo", max_num_seqs=4, slo_classes=CLASSES),
    )
    yield from running_stack(settings)


async def _loaded_engine(c: AsyncClient, log_dir: Path) -> str:
    """The engine the burst went to, once its report predicts a queue past a second."""
    deadline = time.monotonic() + 10.0 + SLOW_HOST_MARGIN_S
    while True:
        await asyncio.sleep(HEARTBEAT_S / 4)
        assert time.monotonic() < deadline, "no engine reported a queue"
        on = engine_of_client_ids(log_dir).get("load-0")
        if on is not None and ((await c.stats())["engines"][on] or {}).get("slo_queue_s", 0) > 1:
            return on


def test_a_targeted_request_goes_to_the_engine_predicted_to_meet_it(stack: LocalStack) -> None:
    address, log_dir = stack.frontend_address, Path(stack.log_dir)
    params: dict[str, Any] = dict(max_tokens=4, temperature=0.0)
    late: dict[str, dict[str, Any]] = {
        "plain": {},  # no targets: cache-aware keeps the prompt on the loaded engine
        "by-class": {"slo_class": "tight"},  # its class only: the engines' table resolves it
        "own": {"ttft_ms": 300.0},  # its own target
    }

    async def scenario() -> str:
        async with AsyncClient(address, timeout=120.0) as c:
            burst = [
                c.generate(PROMPT, max_tokens=160, temperature=0.0, request_id=f"load-{i}")
                for i in range(32)
            ]  # 32 x 160 decode steps on 4 slots: seconds of queue
            load = asyncio.gather(*burst)
            loaded = await _loaded_engine(c, log_dir)
            await asyncio.sleep(HEARTBEAT_S * 1.5)  # the frontend heard a report with the queue
            sent = [c.generate(PROMPT, request_id=rid, **params, **extra)
                    for rid, extra in late.items()]  # fmt: skip
            await asyncio.gather(load, *sent)
            return loaded

    loaded = asyncio.run(scenario())
    engines = engine_of_client_ids(log_dir)
    assert {engines[f"load-{i}"] for i in range(32)} == {loaded}  # the burst stayed together
    assert engines["plain"] == loaded
    assert engines["by-class"] != loaded and engines["own"] != loaded
