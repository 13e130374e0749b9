"""A decode worker's KV pull does not hold up its steps (services/worker/kv_transfer.py, loop.py):
the real worker loop (`serve_worker`) with a simulated runner pulls over a slow modelled link
while this test, standing in for the scheduler, keeps sending decode plans; steps are answered
while the pull is outstanding, and its `KvPulled` comes once the modelled transfer is over."""

from __future__ import annotations

import threading
import time
from typing import Any

import structlog
import zmq

from services.worker.kv_transfer import KvTransfer
from services.worker.loop import serve_worker
from services.worker.sim.config import SimConfig
from services.worker.sim.kv_link import KvLink, SimKvPool, kv_during_steps
from services.worker.sim.runner import SimRunner
from shared.protocol.codec import decode, encode
from shared.protocol.kv_channel import KvHandover
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import (
    GrantLease,
    KvPulled,
    NewSequence,
    PullKv,
    StepPlan,
    StepResult,
    WorkerReady,
)
from tests.bounds import SLOW_HOST_MARGIN_S

CONFIG = SimConfig(device="h200", model="llama-3-8b", num_blocks=64, max_model_len=1024)
SLOW = KvLink("slow", 40e6, 0.0, "a slow link for the test", one_sided=False)  # 40 MB/s
NUM_PULLED = 4  # blocks: 4 x 16 x 128 KiB = 8.4 MB, ~0.2 s on the slow link


def test_decode_steps_go_on_while_a_pull_is_outstanding() -> None:
    context = zmq.Context()
    log = structlog.get_logger()
    slow = SimKvPool(CONFIG.device_profile(), CONFIG.model_shape(), 16, SLOW)
    prefill = KvTransfer(slow, context, log, bind_addr="tcp://127.0.0.1:0")
    decode_side = KvTransfer(slow, context, log, pull_timeout_s=5.0)
    scheduler = context.socket(zmq.ROUTER)
    scheduler.setsockopt(zmq.RCVTIMEO, int((10 + SLOW_HOST_MARGIN_S) * 1000))
    port = scheduler.bind_to_random_port("tcp://127.0.0.1")
    runner = SimRunner(CONFIG, log, wait=kv_during_steps(decode_side, one_sided=False))
    stop = threading.Event()
    worker = threading.Thread(target=serve_worker, daemon=True, args=(
        runner, f"tcp://127.0.0.1:{port}", 0, log), kwargs=dict(
        stop=stop, context=context, trim_heap_when_idle=False, kv=decode_side))  # fmt: skip
    serving = threading.Thread(target=_serve_reads, args=(prefill, stop), daemon=True)
    worker.start()
    serving.start()
    try:
        ident, ready = _recv(scheduler)
        assert isinstance(ready, WorkerReady)
        blocks = list(range(20, 60))  # room for 600 decodes
        seq = NewSequence("a", list(range(100, 116)), 16, blocks, SamplingParams(max_tokens=900), 0)
        scheduler.send_multipart([ident, encode(StepPlan(0, None, 1, 16, [seq], count_slots=[0],
                                                         counts=[16]))])  # fmt: skip
        assert isinstance(_recv(scheduler)[1], StepResult)
        prefill.on_message(GrantLease(1, 7, list(range(NUM_PULLED))))
        ref = KvHandover(1, 7, list(range(NUM_PULLED)), 16 * NUM_PULLED, 16, prefill.endpoint)
        pulled_into = list(range(10, 10 + NUM_PULLED))
        scheduler.send_multipart([ident, encode(PullKv("b", ref, pulled_into))])
        began = time.perf_counter()
        num_steps, pulled = _decode_until_pulled(scheduler, ident)
        elapsed = time.perf_counter() - began
    finally:
        stop.set()
        worker.join(timeout=30)
        serving.join(timeout=30)
    assert pulled.ok and pulled.num_bytes == slow.num_bytes(NUM_PULLED), pulled
    assert elapsed >= slow.landing_seconds(NUM_PULLED)  # the modelled transfer took its time
    assert num_steps > 0, "no decode step was answered while the pull was outstanding"
    scheduler.close(linger=0)
    prefill.close()
    decode_side.close()
    context.term()


def _decode_until_pulled(scheduler: zmq.Socket, ident: bytes) -> tuple[int, KvPulled]:
    """Decode plans one at a time (each after the last result) until the KvPulled arrives;
    the steps answered before it, and it."""
    step_id, num_steps = 1, 0
    scheduler.send_multipart([ident, encode(StepPlan(step_id, 0, 1, 1))])
    while True:
        msg = _recv(scheduler)[1]
        if isinstance(msg, KvPulled):
            return num_steps, msg
        assert isinstance(msg, StepResult), msg
        num_steps += 1
        assert step_id < 600, "the pull never ended"
        step_id += 1
        scheduler.send_multipart([ident, encode(StepPlan(step_id, step_id - 1, 1, 1))])


def _recv(sock: zmq.Socket) -> tuple[bytes, Any]:
    ident, frame = sock.recv_multipart()
    return ident, decode(frame)


def _serve_reads(prefill: KvTransfer, stop: threading.Event) -> None:
    """The prefill worker's loop, reads only (its lease is granted by the test)."""
    assert prefill.server is not None
    while not stop.is_set():
        if prefill.server.poll(10, zmq.POLLIN):
            prefill.on_readable()
