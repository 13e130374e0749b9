"""The Python client (shared/client) against the shared engine: sync and asyncio, streaming,
abort, cancellation, errors, unreachable engines, and clients that vanish without aborting.
(~30 s, more on a busy machine.)"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from shared.client import AsyncClient, Client, Completion, EngineError
from tests.bounds import SLOW_HOST_MARGIN_S

GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def client(engine: Any) -> Iterator[Client]:
    c = Client(engine.frontend_address, timeout=120)
    yield c
    c.close()


def long_params(c: Client) -> dict[str, Any]:
    """Enough tokens to be still running when the test acts on it."""
    return {"max_tokens": min(2000, c.health()["max_model_len"] - 64), "ignore_eos": True}


# Aborted and vanished clients' requests are promised to be gone within 5 s (README, Faults).
IDLE_WITHIN_S = 5.0 + SLOW_HOST_MARGIN_S


def wait_idle(c: Client, within: float) -> dict[str, Any]:
    """Stats once the frontend has nothing in flight and the engine has freed every block."""
    deadline = time.monotonic() + within
    while True:
        stats = c.stats()
        engine = stats["engine"] or {}
        idle = (
            stats["frontend"]["requests_in_flight"] == 0
            and engine.get("num_running") == 0
            and engine.get("num_waiting") == 0
            and engine.get("kv_blocks_used") == 0
        )
        if idle:
            return stats
        assert time.monotonic() < deadline, f"not idle after {within} s: {stats}"
        time.sleep(0.2)


# ---- sync ------------------------------------------------------------------------------------


def test_generate_and_stream_agree(client: Client) -> None:
    whole = client.generate("The sky is", **GREEDY)
    assert isinstance(whole, Completion) and whole.finish_reason == "length"
    assert len(whole.token_ids) == 8 and whole.usage["completion_tokens"] == 8
    it = client.stream("The sky is", **GREEDY)
    chunks = list(it)
    assert it.done is not None and it.done.finish_reason == "length"
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert all(c.id == it.id for c in chunks)
    again = client.generate("The sky is", stream=True, **GREEDY)  # streamed under the hood
    assert again.text == whole.text and again.timings["ttft_s"] is not None


def test_chat_messages_and_request_id(client: Client) -> None:
    done = client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                           request_id="my-id")  # fmt: skip
    assert done.id == "my-id" and done.usage["prompt_tokens"] > 5


def test_error_reply_raises_engine_error(client: Client) -> None:
    with pytest.raises(EngineError) as info:
        client.generate("x", temperature=-1)
    assert info.value.code == "invalid_params"
    with pytest.raises(EngineError) as info:
        list(client.stream("x", no_such_param=1))
    assert info.value.code == "invalid_params"
    assert client.generate("x", max_tokens=2).usage["completion_tokens"] >= 1


def test_closing_a_stream_aborts_it(client: Client) -> None:
    it = client.stream("Count to a thousand:", **long_params(client))
    first = next(it)
    assert first.token_ids
    it.close()
    wait_idle(client, IDLE_WITHIN_S)
    assert client.abort(it.id) is False  # already gone: acknowledged, not an error


def test_abort_ends_the_stream_with_done(client: Client) -> None:
    it = client.stream("Count:", **long_params(client))
    next(it)
    assert client.abort(it.id) is True
    list(it)
    assert it.done is not None and it.done.finish_reason == "abort"
    wait_idle(client, IDLE_WITHIN_S)


def test_vanished_clients_are_aborted_within_5_s(engine: Any, client: Client) -> None:
    params = long_params(client)
    streaming = Client(engine.frontend_address)
    it = streaming.stream("Count:", **params)  # kept: dropping it would abort the request
    next(it)
    # A non-streaming request is silent until done: only heartbeats can find its client gone.
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(engine.frontend_address)
    rid = uuid.uuid4().hex
    msg = {"type": "generate", "v": 1, "id": rid, "prompt": "Count:", "params": params}
    raw.send(msgpack.packb(msg))
    deadline = time.monotonic() + 30
    while client.stats()["frontend"]["requests_in_flight"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    streaming.close()  # no abort sent by either
    raw.close(0)
    wait_idle(client, IDLE_WITHIN_S)


def test_unreachable_engine_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = Client(f"tcp://127.0.0.1:{port}", timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(EngineError) as info:
        c.generate("x")
    # the client promises its own timeout (0.5 s here)
    assert info.value.code == "engine_unreachable"
    assert time.monotonic() - t0 < 0.5 + SLOW_HOST_MARGIN_S
    with pytest.raises(EngineError):
        c.health()
    c.close()


# ---- asyncio ---------------------------------------------------------------------------------


def test_async_client(engine: Any, client: Client) -> None:
    params = long_params(client)

    async def main() -> None:
        async with AsyncClient(engine.frontend_address, timeout=120) as ac:
            assert (await ac.health())["ready"] is True
            whole = await ac.generate("The sky is", **GREEDY)
            streamed = [c async for c in ac.stream("The sky is", **GREEDY)]
            assert "".join(c.text for c in streamed) == whole.text
            many = await asyncio.gather(
                *[ac.generate(f"Story {i}:", stream=i % 2 == 0, max_tokens=4 + i % 5,
                              ignore_eos=True) for i in range(16)]
            )  # fmt: skip
            assert [m.usage["completion_tokens"] for m in many] == [4 + i % 5 for i in range(16)]
            with pytest.raises(EngineError) as info:
                await ac.generate("x", top_p=2)
            assert info.value.code == "invalid_params"

            it = ac.stream("Count:", **params)
            await it.__anext__()
            assert await ac.abort(it.id) is True
            rest = [c async for c in it]
            assert it.done is not None and it.done.finish_reason == "abort" and len(rest) < 5

            async def consume() -> None:
                async for _ in ac.stream("Count:", **params):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.5)
            task.cancel()  # e.g. an HTTP client went away: the request must be aborted
            with pytest.raises(asyncio.CancelledError):
                await task
            stats = await ac.stats()
            assert stats["engine"] is not None

    asyncio.run(main())
    wait_idle(client, IDLE_WITHIN_S)
