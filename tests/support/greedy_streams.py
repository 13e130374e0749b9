"""Greedy streams of several prompts at once through a frontend, for e2e tests that compare
the streamed tokens with a reference (the disaggregated tensor-parallel stacks)."""

from __future__ import annotations

import asyncio

from shared.client import AsyncClient


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
