"""A real stack (tokenizer + scheduler + SIMULATED worker processes) serves the client protocol.

The simulated worker models Llama-3-8B on an H200: a decode step takes ~5.4 ms, and tokens are
deterministic and never end-of-sequence, so every output is exactly `max_tokens` long.
Rough runtime: 15-40 s on the shared 2-core machine (mostly starting the services).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import pytest

from conveyor.launcher import LocalStack, StackSettings
from services.scheduler.config import SchedulerConfig
from services.scheduler.server_config import ServerConfig
from services.worker.sim.config import SimConfig
from services.worker.sim.cost_model import step_cost, step_work
from services.worker.sim.profiles import DEVICES, MODELS
from shared.client import AsyncClient, Client
from tests.e2e.stack_tools import running_stack

pytestmark = pytest.mark.e2e

PROMPT = "The conveyor belt carries parcels"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    settings = StackSettings(
        worker="sim",
        sim_config=SimConfig(device="h200", model="llama-3-8b", report_every=10),
        frontend_address=f"tcp://127.0.0.1:{_free_port()}",
        gateway=False,
        log_dir=tmp_path_factory.mktemp("logs"),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
    )
    yield from running_stack(settings)


def test_handshake_reports_the_simulated_device(stack: LocalStack) -> None:
    with Client(stack.frontend_address) as c:
        health = c.health()
    assert health["ready"] is True
    assert health["model"] == "sim:llama-3-8b"
    assert health["vocab_size"] == 128256


def test_outputs_are_exactly_max_tokens_and_deterministic(stack: LocalStack) -> None:
    with Client(stack.frontend_address) as c:
        first = c.generate(PROMPT, max_tokens=24, temperature=0.8, seed=11)
        again = c.generate(PROMPT, max_tokens=24, temperature=0.8, seed=11, stream=True)
        other = c.generate(PROMPT, max_tokens=24, temperature=0.8, seed=12)
    assert first.finish_reason == "length" and len(first.token_ids) == 24
    assert first.usage["completion_tokens"] == 24
    assert again.token_ids == first.token_ids and again.text == first.text
    assert other.token_ids != first.token_ids
    assert first.text  # ordinary tokens: the real tokenizer detokenizes them


def test_steps_take_the_modelled_time(stack: LocalStack) -> None:
    decode = step_cost(DEVICES["h200"], step_work(MODELS["llama-3-8b"], [10], [1], 1)).total_s
    with Client(stack.frontend_address) as c:
        start = time.perf_counter()
        out = c.generate(PROMPT, max_tokens=40, temperature=0.0)
        elapsed = time.perf_counter() - start
    assert len(out.token_ids) == 40
    # 1 prefill + 39 decodes, each at least the modelled ~5.4 ms
    assert elapsed >= 39 * decode


def test_concurrent_requests_each_get_their_length(stack: LocalStack) -> None:
    lengths = [5, 17, 33, 64, 9, 50, 21, 40, 12, 28]  # more than max_num_seqs: some wait

    async def run() -> list[int]:
        client = AsyncClient(stack.frontend_address)
        try:
            outs = await asyncio.gather(
                *(client.generate(PROMPT, max_tokens=n, seed=i) for i, n in enumerate(lengths))
            )
        finally:
            await client.close()
        return [len(o.token_ids) for o in outs]

    assert asyncio.run(run()) == lengths


def test_worker_log_says_simulated(stack: LocalStack) -> None:
    lines = [json.loads(x) for x in Path(stack.log_dir, "worker.log").read_text().splitlines()
             if x.startswith("{")]  # fmt: skip
    start = [x for x in lines if x.get("event") == "sim_worker_start"]
    assert start and "SIMULATED" in start[0]["note"]
    assert all(x.get("simulated") is True for x in lines)
    # the 40-token request alone gave 39 decode steps at batch 1: engine-gap summaries
    gaps = [x for x in lines if x.get("event") == "sim_engine_gap" and x["num_seqs"] == 1]
    assert gaps and all(x["steps"] == 10 and 0 < x["gap_p50_us"] <= x["gap_p99_us"] for x in gaps)


def test_a_frontend_slower_than_the_engine_keeps_its_requests(tmp_path: Path) -> None:
    """Zero-cost steps with hundreds running: the scheduler emits outputs faster than the
    tokenizer detokenizes them, so output batches queue up at the frontend. Its heartbeat must
    still reach the scheduler in time (here 2 s), or every request would be aborted as the
    requests of a vanished frontend."""
    settings = StackSettings(
        worker="sim",
        sim_config=SimConfig(device="none"),
        frontend_address=f"tcp://127.0.0.1:{_free_port()}",
        gateway=False,
        log_dir=tmp_path,
        scheduler_config=SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=8192),
        server_config=ServerConfig(frontend_timeout_s=2.0),
    )
    n, max_tokens = 512, 400

    async def run(address: str) -> list[int]:
        async with AsyncClient(address, timeout=120.0) as client:
            outs = await asyncio.gather(
                *(client.generate(prompt_token_ids=[1000] * 8, max_tokens=max_tokens, seed=i,
                                  ignore_eos=True)
                  for i in range(n))
            )  # fmt: skip
        return [len(o.token_ids) for o in outs]

    with LocalStack(settings) as st:
        assert asyncio.run(run(st.frontend_address)) == [max_tokens] * n
    assert "silent for" not in Path(tmp_path, "scheduler.log").read_text()
