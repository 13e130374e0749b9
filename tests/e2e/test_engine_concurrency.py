"""Issue test 2: 64 concurrent streaming clients on the shared engine all complete, and the
scheduler's step log shows continuous batching: requests join and leave the running batch
between steps, and some steps mix prefill chunks with decodes.

Prompts are 1-64 random token ids, outputs 4-32 tokens with EOS ignored (so every length is
known). Rough runtime: 20-90 s on the shared 2-core machine (fp32 model).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from shared.client import AsyncClient

pytestmark = [pytest.mark.e2e, pytest.mark.model]

NUM_CLIENTS = 64


def _workload(seed: int = 4) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "request_id": f"conc-{i}",
            "prompt_token_ids": [rng.randrange(300, 20000) for _ in range(rng.randint(1, 64))],
            "max_tokens": rng.randint(4, 32),
        }
        for i in range(NUM_CLIENTS)
    ]


async def _one_client(address: str, req: dict[str, Any]) -> tuple[list[int], Any]:
    async with AsyncClient(address, timeout=300.0) as client:
        stream = client.stream(
            prompt_token_ids=req["prompt_token_ids"],
            request_id=req["request_id"],
            max_tokens=req["max_tokens"],
            temperature=0.0,
            ignore_eos=True,
        )
        ids: list[int] = []
        async for chunk in stream:
            ids.extend(chunk.token_ids)
        return ids, stream.done


async def _run_all(address: str, reqs: list[dict[str, Any]]) -> list[tuple[list[int], Any]]:
    return await asyncio.gather(*(_one_client(address, r) for r in reqs))


def _our_rids(engine: Any, client_ids: set[str]) -> set[str]:
    """Internal rids of our requests, from the tokenizer's `request_received` lines."""
    return {
        r["rid"]
        for r in engine.log_records("tokenizer")
        if r.get("event") == "request_received" and r.get("client_id") in client_ids
    }


def _steps_with(engine: Any, rids: set[str]) -> list[dict[str, Any]]:
    """Step lines of the scheduler that carried any of `rids`, once all of them finished."""
    deadline = time.monotonic() + 10.0
    while True:  # the launcher's log writer may lag the replies by a moment
        records = engine.log_records("scheduler")
        finished = {r.get("rid") for r in records if r.get("event") == "request_finished"}
        if rids <= finished or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    steps = [r for r in records if r.get("event") == "step" and rids & set(r["rids"])]
    return sorted(steps, key=lambda r: r["step_id"])


def test_64_streaming_clients_complete_with_continuous_batching(engine: Any) -> None:
    reqs = _workload()
    results = asyncio.run(_run_all(engine.frontend_address, reqs))
    for req, (ids, done) in zip(reqs, results, strict=True):
        assert done is not None and done.finish_reason == "length", req["request_id"]
        assert len(ids) == req["max_tokens"] == done.usage["completion_tokens"]
        assert done.usage["prompt_tokens"] == len(req["prompt_token_ids"])

    rids = _our_rids(engine, {r["request_id"] for r in reqs})
    assert len(rids) == NUM_CLIENTS
    steps = _steps_with(engine, rids)
    assert {rid for s in steps for rid in s["rids"]} == rids
    joined = left = mixed = 0
    for prev, cur in zip(steps, steps[1:], strict=False):
        before, after = set(prev["rids"]), set(cur["rids"])
        if before & after:  # the batch carried on across these two steps...
            joined += bool(after - before)  # ...while someone joined it
            left += bool(before - after)  # ...or someone left it
    for s in steps:
        kinds = set(s["is_prefill"])
        mixed += kinds == {True, False}
    assert joined > 0, "no request joined a running batch"
    assert left > 0, "no request left a running batch while others kept running"
    assert mixed > 0, "no step mixed prefill chunks with decodes"
