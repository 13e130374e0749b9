"""Fuzzing the client protocol against a live frontend: random msgpack values, random bytes and
mutated valid requests (hypothesis), 10,000 frames by default (CONVEYOR_FUZZ_FRAMES; `make fuzz`
runs 200,000). Passes when no frame gets `internal_error` (every rejection has its own code),
no service exits or logs a caught exception, and the engine then serves a valid request.

Hypothesis draws the frames; each drawn frame is followed by byte-level mutations of itself
(truncated, a byte flipped, a slice repeated, garbage appended; positions drawn by hypothesis),
which reach the decoder's error paths cheaply. Frames go out in batches on one DEALER; each
batch ends with aborts for the generate ids it sent (so valid requests stay short) and a `health`
marker: the frontend answers in order, so once the marker's reply is back, every synchronous
answer to the batch has been read.
Simulated worker with zero-cost steps: the frontend is what is tested. Also here: 1,000 streams
aborted by their clients at random points leave no KV block in use. Rough runtime: 40-80 s.
"""

from __future__ import annotations

import asyncio
import copy
import math
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.launcher import LocalStack, StackSettings
from services.worker.sim.config import SimConfig
from shared.client import AsyncClient, Client
from shared.env import env_int
from shared.protocol.client_channel import PARAM_NAMES
from tests.bounds import SLOW_HOST_MARGIN_S
from tests.e2e.stack_tools import free_port

pytestmark = pytest.mark.e2e

DRAWN_PER_BATCH = 10  # frames hypothesis draws per batch ...
DERIVED_PER_FRAME = 9  # ... each followed by this many byte-level mutations of itself
BATCH = DRAWN_PER_BATCH * (1 + DERIVED_PER_FRAME)
NUM_FRAMES = env_int("FUZZ_FRAMES", 10_000) or 10_000
REPLY_WITHIN_S = 10.0 + SLOW_HOST_MARGIN_S  # a batch of 100 frames answered within 10 s
NUM_ABORTED = 1000

_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),  # NaN and +-inf included
    st.sampled_from([math.nan, math.inf, -math.inf, 1e-300, 0.0, -0.0, 2**63, 2**64 - 1, -1]),
    st.text(max_size=24),
    st.binary(max_size=24),
)
_VALUE = st.recursive(
    _LEAF,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=10) | st.integers(-5, 5), inner, max_size=5)
    ),
    max_leaves=16,
)
_TOP_KEYS = ["type", "v", "id", "prompt", "messages", "prompt_token_ids", "stream", "priority",
             "params", "add_generation_prompt"]  # fmt: skip
_BASES: list[dict[str, Any]] = [
    {"type": "generate", "v": 1, "prompt": "hello there", "params": {"max_tokens": 4}},
    {"type": "generate", "v": 1, "stream": True, "params": {"max_tokens": 3, "temperature": 0.7},
     "messages": [{"role": "user", "content": "hi"}]},
    {"type": "generate", "v": 1, "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 2,
     "stop": ["x"], "stop_token_ids": [5], "logprobs": 2, "seed": 7}},
    {"type": "abort", "v": 1},
    {"type": "health", "v": 1},
    {"type": "stats", "v": 1},
]  # fmt: skip


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    """A valid request with 1-3 fields set to random values, deleted, or added."""
    wire = copy.deepcopy(draw(st.sampled_from(_BASES)))
    wire["id"] = f"f{draw(st.integers(0, 10**9))}"
    for _ in range(draw(st.integers(1, 3))):
        params = wire.get("params")
        in_params = isinstance(params, dict) and draw(st.booleans())
        target = params if in_params else wire
        names = list(PARAM_NAMES) if in_params else _TOP_KEYS
        key = draw(st.sampled_from(names) | st.text(max_size=8))
        if draw(st.integers(0, 3)) == 0:
            target.pop(key, None)
        else:
            target[key] = draw(_VALUE)
    return msgpack.packb(wire, use_bin_type=True)


_FRAME = st.one_of(
    _mutated(),
    _mutated(),
    _VALUE.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    st.binary(max_size=64),
)


def _derived(frame: bytes, rnd: random.Random) -> list[bytes]:
    """DERIVED_PER_FRAME byte-level mutations of one frame."""
    out = []
    for i in range(DERIVED_PER_FRAME):
        cut = rnd.randrange(len(frame) + 1)
        kind = i % 4
        if kind == 0:
            out.append(frame[:cut])
        elif kind == 1:
            flipped = bytearray(frame or b"\x00")
            flipped[cut % len(flipped)] ^= 1 << rnd.randrange(8)
            out.append(bytes(flipped))
        elif kind == 2:
            out.append(frame[:cut] + frame[cut // 2 : cut] + frame[cut:])
        else:
            out.append(frame + rnd.randbytes(rnd.randrange(1, 16)))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    settings_ = StackSettings(
        worker="sim",
        sim_config=SimConfig(device="none"),
        frontend_address=f"tcp://127.0.0.1:{free_port()}",
        gateway=False,
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    st_ = LocalStack(settings_).start()
    try:
        st_.wait_ready(timeout=180)
        yield st_
    finally:
        st_.stop()


class Tally:
    def __init__(self) -> None:
        self.frames = 0
        self.codes: Counter[str] = Counter()


def _exchange(sock: zmq.Socket, frames: list[bytes], tally: Tally, marker: str) -> None:
    """Send a batch, abort its generate ids, then read replies up to the marker's."""
    ids = []
    for frame in frames:
        sock.send(frame)
        try:
            wire = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except Exception:  # noqa: BLE001 - random bytes: nothing to abort
            continue
        if isinstance(wire, dict) and wire.get("type") == "generate":
            if isinstance(wire.get("id"), str) and 0 < len(wire["id"]) <= 256:
                ids.append(wire["id"])
    for rid in ids:
        sock.send(msgpack.packb({"type": "abort", "v": 1, "id": rid}))
    sock.send(msgpack.packb({"type": "health", "v": 1, "id": marker}))
    tally.frames += len(frames)
    deadline = time.monotonic() + REPLY_WITHIN_S
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000)), "the frontend stopped answering"
        msg = msgpack.unpackb(sock.recv(), raw=False)
        if msg.get("type") == "error":
            tally.codes[msg["code"]] += 1
        if msg.get("type") == "health" and msg.get("id") == marker:
            return


def test_fuzzed_frames_get_specific_codes_and_the_engine_serves_after(stack: LocalStack) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stack.frontend_address)
    tally = Tally()

    @settings(
        max_examples=math.ceil(NUM_FRAMES / BATCH),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.lists(_FRAME, min_size=DRAWN_PER_BATCH, max_size=DRAWN_PER_BATCH),
        st.randoms(use_true_random=False),
    )
    def fuzz(drawn: list[bytes], rnd: random.Random) -> None:
        frames = [f for frame in drawn for f in (frame, *_derived(frame, rnd))]
        _exchange(sock, frames, tally, f"marker-{tally.frames}")

    try:
        fuzz()
    finally:
        sock.close()
    print(f"\nfuzzed frames: {tally.frames}, error codes: {dict(tally.codes)}")  # RELIABILITY.md
    assert tally.frames >= NUM_FRAMES
    assert tally.codes["internal_error"] == 0
    assert len(tally.codes) >= 6  # the frames reached many different checks
    assert stack.is_ready()  # raises when a service exited, False when one is not ready
    with Client(stack.frontend_address) as c:
        out = c.generate("after the fuzz", max_tokens=5, temperature=0.0)
    assert len(out.token_ids) == 5
    for name in ("tokenizer", "scheduler", "worker"):
        text = Path(stack.log_dir, f"{name}.log").read_text(errors="replace")
        assert "_message_failed" not in text and "Traceback" not in text, name


def test_streams_aborted_at_random_points_leak_no_block(stack: LocalStack) -> None:
    """1,000 streams, each closed by its client after a random number of chunks (0 included:
    some are aborted before their first token): the engine ends with 0 KV blocks in use."""
    rnd = random.Random(14)
    cut_after = [rnd.randrange(0, 6) for _ in range(NUM_ABORTED)]

    async def one(client: AsyncClient, n: int, sem: asyncio.Semaphore) -> None:
        async with sem:
            stream = client.stream(f"abort me {n}", max_tokens=400, ignore_eos=True)
            try:
                got = 0
                async for _chunk in stream:
                    got += 1
                    if got >= cut_after[n]:
                        break
            finally:
                await stream.aclose()  # aborts the request in the engine

    async def run() -> None:
        sem = asyncio.Semaphore(64)
        async with AsyncClient(stack.frontend_address, timeout=60.0) as client:
            await asyncio.gather(*(one(client, n, sem) for n in range(NUM_ABORTED)))

    asyncio.run(run())
    deadline = time.monotonic() + 10
    with Client(stack.frontend_address) as c:
        while True:
            engine = c.stats()["engine"]
            if engine["kv_blocks_used"] == 0 and engine["num_live_requests"] == 0:
                break
            assert time.monotonic() < deadline, engine
            time.sleep(0.2)
