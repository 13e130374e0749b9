"""What the disaggregated tensor-parallel e2e tests share: their prompts, worker settings and
tiny model, and greedy streams of several prompts at once through a frontend."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.worker.config import WorkerConfig
from shared.client import AsyncClient
from tests.support.tiny_model import write_tiny_model

# fp32 torch attention, a small pool: the same numbers on every rank split
HANDOVER_WORKER = WorkerConfig(
    dtype="float32", quantization="none", kv_cache_memory=16 << 20, max_model_len=256,
    attention_backend="torch",
)  # fmt: skip


def handover_prompts(count: int) -> list[list[int]]:
    """36-40 tokens each: two full blocks of 16 to pull, the tail recomputed on the decode side."""
    return [[40 + i, 50, 60 + i, 70, *range(80 + i, 112 + 2 * i)] for i in range(count)]


def write_two_kv_head_model(folder: Path) -> Path:
    """A tiny Llama of 4 query and 2 KV heads: its KV splits over 1 or 2 ranks."""
    return write_tiny_model(folder, num_attention_heads=4, num_key_value_heads=2)


def stream_greedy(
    address: str, prompts: list[list[int]], max_tokens: int, wait_s: float
) -> list[list[int]]:
    """Every prompt streamed concurrently (greedy, `ignore_eos`): the tokens of each, in order."""

    async def run() -> list[list[int]]:
        async with AsyncClient(address, timeout=wait_s) as client:

            async def one(ids: list[int]) -> list[int]:
                tokens: list[int] = []
                async for chunk in client.stream(prompt_token_ids=ids, max_tokens=max_tokens,
                                                 temperature=0.0, ignore_eos=True):  # fmt: skip
                    tokens += chunk.token_ids
                return tokens

            return list(await asyncio.wait_for(asyncio.gather(*map(one, prompts)), wait_s))

    return asyncio.run(run())
