"""What the CPU default (`pipeline_steps` auto = off on a CPU) costs per step: run it in two trees.

A tiny random Llama (2 layers, hidden 64: the forward is ~1 ms, so the worker's own per-step
Python is a visible share of it) decodes `--batch` sequences for `--steps` steady steps
(`--rounds` times, each from a fresh batch), one plan at a time: (1) `ModelRunner.execute`
called directly, (2) the same through the real worker loop (`serve_worker` in a thread, a
ROUTER socket here: plan out, result back). Prints the median and mean per step. Only APIs
that exist before step pipelining are used, so the same file runs on an older tree for a
side-by-side figure:

    flock -x /tmp/conveyor-cpu.lock sh -c 'for t in /work/main . /work/main .; do \
        (cd $t && PYTHONPATH=. .venv/bin/python /path/to/bench/pipeline_cpu_cost.py); done'
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import structlog
import zmq

from services.worker.config import WorkerConfig
from services.worker.loop import serve_worker
from services.worker.plan_writer import PlanWriter
from services.worker.runner import ModelRunner
from shared.protocol.codec import decode, encode
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import StepPlan, WorkerShutdown
from tests.support.tiny_model import write_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


def _start(runner: ModelRunner, writer: PlanWriter, batch: int, context: int) -> StepPlan:
    """The first plan: `batch` prompts of `context` tokens prefilled (then every plan decodes)."""
    bs = runner.kv_cache.block_size
    per_seq = -(-runner.max_model_len // bs)  # room for every decode up to max_model_len
    new = [
        writer.new_sequence(
            f"r{i}",
            [3 + (i * 7 + j) % 200 for j in range(context)],
            context,
            list(range(i * per_seq, (i + 1) * per_seq)),
            GREEDY,
        )  # fmt: skip
        for i in range(batch)
    ]
    return writer.plan({s.rid: context for s in new}, new)


def _direct(runner: ModelRunner, batch: int, context: int, steps: int) -> list[float]:
    writer = PlanWriter()
    runner.execute(_start(runner, writer, batch, context))
    times = []
    for _ in range(steps):
        plan = writer.plan({f"r{i}": 1 for i in range(batch)})
        t0 = time.perf_counter()
        runner.execute(plan)
        times.append(time.perf_counter() - t0)
    return times


def _through_loop(runner: ModelRunner, batch: int, context: int, steps: int) -> list[float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    log = structlog.get_logger().bind(service="worker")
    thread = threading.Thread(
        target=serve_worker,
        args=(runner, f"tcp://127.0.0.1:{port}", 0, log),
        kwargs={"context": ctx, "trim_heap_when_idle": False},
        daemon=True,
    )
    thread.start()
    identity, _ready = sock.recv_multipart()
    writer = PlanWriter(first_step_id=10_000)  # a reset plan: the batch starts afresh
    sock.send_multipart([identity, encode(_start(runner, writer, batch, context))])
    sock.recv_multipart()
    times = []
    for _ in range(steps):
        plan = writer.plan({f"r{i}": 1 for i in range(batch)})
        t0 = time.perf_counter()
        sock.send_multipart([identity, encode(plan)])
        decode(sock.recv_multipart()[1])
        times.append(time.perf_counter() - t0)
    sock.send_multipart([identity, encode(WorkerShutdown(reason="bench"))])
    thread.join(timeout=30)
    sock.close(linger=0)
    ctx.term()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=400, help="per round (max_model_len 512)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings
    folder = write_tiny_model(Path(tempfile.mkdtemp()))
    runner = ModelRunner(WorkerConfig(model=str(folder), dtype="float32", kv_cache_memory=64 << 20))
    for name, fn in (("execute", _direct), ("loop", _through_loop)):
        t = [
            x for _ in range(args.rounds) for x in fn(runner, args.batch, args.context, args.steps)
        ]
        print(f"{Path.cwd().name:>8} {name:>7} B={args.batch}: median "
              f"{1e6 * statistics.median(t):7.1f} us, mean {1e6 * statistics.fmean(t):7.1f} us "
              f"over {len(t)} steps", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
