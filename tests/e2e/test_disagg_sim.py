"""Prefill and decode apart on the SIMULATED worker (issue 32): real processes, the KV
hand-over's real messages and sockets, the transfer's time modelled (sim/kv_link.py), so a P:D
stack of simulated H200s runs end to end, cheaply.

* `health` and `conveyor top` name each engine's role;
* under sustained load (requests arriving while others decode), every request is handed over
  and pulled, completes with the colocated stack's tokens, the pulled bytes are the model's
  KV of the pulled blocks, and afterwards no block and no lease is held on either side.
Rough runtime: 15-30 s on the shared 2-core machine (two small simulated stacks).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest
from rich.console import Console

from conveyor.launcher import LocalStack, StackSettings
from conveyor.top import EngineSampler, render
from services.scheduler.config import SchedulerConfig
from services.worker.sim.config import SimConfig
from shared.client import AsyncClient, Client
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import free_port, running_stack

pytestmark = pytest.mark.e2e

BLOCK = 16
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # Llama-3-8B: K and V, 32 layers, 8 KV heads of 128, bf16
NUM_REQUESTS, RATE, MAX_TOKENS = 40, 20.0, 12
WAIT_S = 60.0 + SLOW_HOST_MARGIN_S
RELEASED_S = 5.0 + SLOW_HOST_MARGIN_S  # leases end on HandoverDone; the time-out is 3 s


def prompts() -> list[list[int]]:
    """Distinct prompts of 40-700 tokens (2-43 full blocks each: every one is pulled)."""
    return [[300 + (97 * i + 13 * j) % 20000 for j in range(40 + 17 * i)] for i in range(40)]


def settings(log_dir: Path, **engines: int) -> StackSettings:
    return StackSettings(
        worker="sim",
        sim_config=SimConfig(device="h200", model="llama-3-8b", num_blocks=4000),
        scheduler_config=SchedulerConfig(
            max_num_seqs=64, max_num_batched_tokens=1024, chunk_size=1024
        ),  # fmt: skip
        frontend_address=f"tcp://127.0.0.1:{free_port()}",
        gateway=False,
        log_dir=log_dir,
        **engines,
    )


@pytest.fixture(scope="module")
def apart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    logs = tmp_path_factory.mktemp("disagg-sim")
    yield from running_stack(settings(logs, prefill_engines=1, decode_engines=1))


@pytest.fixture(scope="module")
def colocated_tokens(tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """The reference: the same prompts through one colocated engine (stopped afterwards)."""
    stacks = running_stack(settings(tmp_path_factory.mktemp("colocated-sim")))
    stack = next(stacks)
    try:
        return asyncio.run(_load(stack.frontend_address, rate=None))
    finally:
        stacks.close()


async def _load(address: str, rate: Optional[float]) -> list[list[int]]:
    """Every prompt, arriving `rate` per second (None: all at once); their output tokens."""

    async def one(i: int, prompt: list[int]) -> list[int]:
        if rate is not None:
            await asyncio.sleep(i / rate)
        done = await client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0.0, ignore_eos=True)  # fmt: skip
        return list(done.token_ids)

    async with AsyncClient(address, timeout=WAIT_S) as client:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts())))


def test_health_and_top_name_the_roles(apart: LocalStack) -> None:
    with Client(apart.frontend_address, timeout=WAIT_S) as client:
        engines = client.health()["engines"]
    assert [(e["engine"], e["role"]) for e in engines] == [("0", "prefill"), ("1", "decode")]
    sampler = EngineSampler(apart.frontend_address, timeout=WAIT_S)
    try:
        views = sampler.sample()
    finally:
        sampler.close()
    assert [v.role for v in views] == ["prefill", "decode"]
    console = Console(record=True, width=160, color_system=None)
    console.print(render(views, interval=1.0))
    text = console.export_text()
    assert "#0" in text and "#1" in text and "prefill" in text and "decode" in text


def test_sustained_load_is_all_handed_over_and_nothing_stays_held(
    apart: LocalStack, colocated_tokens: list[list[int]]
) -> None:
    before = _engine_stats(apart)
    outputs = asyncio.run(_load(apart.frontend_address, rate=RATE))
    assert outputs == colocated_tokens
    assert all(len(out) == MAX_TOKENS for out in outputs)
    deadline = time.monotonic() + RELEASED_S
    while True:
        after = _engine_stats(apart)
        prefill, decode = after["0"], after["1"]
        if prefill["num_leases"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    grown = {k: decode[k] - before["1"][k] for k in ("num_kv_pulls", "kv_pull_bytes")}
    handed_over = prefill["num_finished_handover"] - before["0"].get("num_finished_handover", 0)
    assert handed_over == NUM_REQUESTS
    assert grown["num_kv_pulls"] == NUM_REQUESTS and decode["num_kv_pull_failures"] == 0
    num_blocks = sum(len(p) // BLOCK for p in prompts())
    assert grown["kv_pull_bytes"] == num_blocks * BLOCK * KV_PER_TOKEN
    assert prefill["num_leases"] == 0 and prefill["num_leases_expired"] == 0
    assert prefill["kv_blocks_used"] == 0 and decode["kv_blocks_used"] == 0
    assert decode["num_kv_pulling"] == 0 and decode["num_running"] == 0


def _engine_stats(stack: LocalStack) -> dict[str, dict[str, float]]:
    with Client(stack.frontend_address, timeout=WAIT_S) as client:
        return client.stats()["engines"]
