"""The scheduler's own cost per step, result frame to plan frame, with no worker and no sockets.

    PYTHONPATH=. .venv/bin/python bench/scheduler_bench.py --running 256,1024 --steps 200

For each N it fills the batch with N requests of `--context` tokens (block size 16), runs them
until all N are decoding, then times `--steps` steps of pure decode, and again `--steps` mixed
steps in which a new `--context`-token prompt is prefilled in `--chunk`-token chunks beside the N
decodes. Timed per step, as the server runs them between a result and the next plan: decoding
the result frame, `update()`, `schedule()`, encoding the plan frame. The "worker" answers
instantly with a fixed token; building and encoding its answer is not timed.
Goal: <= 200 us per step at 256 running. Run it on a quiet machine only (not while tests or
other benchmarks run); the figures go in docs/PERFORMANCE.md. Writes JSON to --out.

Every prompt is distinct (no shared prefix: 0% prefix-cache hits), and sampled tokens differ
per request, so prefix caching costs here what it costs a workload it cannot help.
`--prefix-caching on,off` times each scenario with caching on and off, interleaved
(`--repeats` rounds of on, off), and reports the median of each mode's per-round medians and
their ratio. `after_plan` (the registrations the server runs off the result -> plan path, while
the worker computes) is timed apart, as `after_plan_us_median`.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import zlib
from pathlib import Path

from services.scheduler import Scheduler, SchedulerConfig
from shared.protocol.codec import decode, encode
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import StepPlan, StepResult

VOCAB = 49152


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", default="256,1024", help="running decodes, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="timed steps per scenario")
    p.add_argument("--context", type=int, default=2048, help="tokens per request when timed")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk in the mixed steps")
    p.add_argument("--out", type=Path, default=Path("results/scheduler_bench.json"))
    p.add_argument(
        "--prefix-caching", default="on", help="on | off | on,off | off,on (interleaved, in order)"
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds of on,off when comparing")
    return p.parse_args(argv)


def _answer(plan: StepPlan) -> StepResult:
    """Each sampled token differs per request and step (decode-filled blocks never match)."""
    rids = [rid for rid, s in zip(plan.rids, plan.sample, strict=True) if s]
    base = plan.step_id * 7919
    return StepResult(plan.step_id, rids, [(base + i) % VOCAB for i in range(len(rids))])


def _submit(rid: str, prompt_len: int, max_tokens: int) -> SubmitRequest:
    """A prompt no other request shares (its first token differs)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    first = zlib.crc32(rid.encode()) % VOCAB
    prompt = [(first + i) % VOCAB for i in range(prompt_len)]
    return SubmitRequest(rid, prompt, sampling)


def _warm_up(n: int, args: argparse.Namespace, steps: int, caching: bool = True) -> Scheduler:
    """N requests whose prompt is `context - 1` tokens, prefilled and decoding."""
    bs = args.block_size
    blocks_each = -(-(args.context + 2 * steps + 16) // bs)
    config = SchedulerConfig(
        max_num_seqs=n + 1,  # room for the prompt of the mixed steps
        max_num_batched_tokens=max(n + args.chunk, 65536),  # large: a short warm-up
        chunk_size=args.chunk,
        max_waiting=n + 4 * steps,
        watermark=0.0,
        enable_prefix_caching=caching,
    )
    num_blocks = (n + 2) * blocks_each
    sched = Scheduler(config, num_blocks, bs, 16 * args.context, [-1], cache_namespace=b"bench")
    for i in range(n):
        sched.add_request(_submit(f"req-{i:05d}", args.context - 1, 1 << 20))
    while True:
        plan = sched.schedule()
        assert plan is not None
        sched.update(_answer(plan))
        rec = sched.last_step_record
        if rec is not None and not any(rec.is_prefill) and len(rec.rids) == n:
            return sched


def _time_steps(sched: Scheduler, steps: int, new_prompt_len: int) -> dict[str, float]:
    """Time the scheduler's part of one step, piece by piece, as the server runs it between a
    result frame and the next plan frame: decode the result, update(), schedule(), encode the
    plan. With `new_prompt_len`, a new prompt arrives as soon as the previous one is done (so
    every step holds a prefill chunk)."""
    parts: dict[str, list[float]] = {"decode": [], "update": [], "schedule": [], "encode": []}
    after: list[float] = []
    arrivals = 0
    gc.collect()
    plan = sched.schedule()
    assert plan is not None
    for _ in range(steps):
        frame = encode(_answer(plan))  # the worker's side: not timed
        t0 = time.perf_counter()
        result = decode(frame)
        t1 = time.perf_counter()
        sched.update(result)
        t2 = time.perf_counter()
        if new_prompt_len and (arrivals == 0 or not sched.is_live(f"new-{arrivals:05d}")):
            arrivals += 1
            sched.add_request(_submit(f"new-{arrivals:05d}", new_prompt_len, 1))
        t3 = time.perf_counter()
        plan = sched.schedule()
        t4 = time.perf_counter()
        assert plan is not None
        encode(plan)
        t5 = time.perf_counter()
        sched.after_plan()  # the server runs it while the worker computes: timed apart
        after.append((time.perf_counter() - t5) * 1e6)
        for name, a, b in (("decode", t0, t1), ("update", t1, t2), ("schedule", t3, t4)):
            parts[name].append((b - a) * 1e6)
        parts["encode"].append((t5 - t4) * 1e6)
    total = [sum(p) for p in zip(*parts.values(), strict=True)]
    out = {f"{name}_us_median": statistics.median(v) for name, v in parts.items()}
    out.update(
        after_plan_us_median=statistics.median(after),
        step_us_median=statistics.median(total),
        step_us_min=min(total),  # the least disturbed step: best guess on a shared machine
        step_us_p90=sorted(total)[int(0.9 * (len(total) - 1))],
        step_us_max=max(total),
    )
    return out


def _run(n: int, args: argparse.Namespace, scenario: str, caching: bool) -> dict[str, float]:
    sched = _warm_up(n, args, args.steps, caching)
    r = _time_steps(sched, args.steps, args.context if scenario == "mixed" else 0)
    print(
        f"N={n:5d} {scenario:6s} caching {'on ' if caching else 'off'} step "
        f"{r['step_us_median']:8.1f} us median (decode {r['decode_us_median']:.1f} + update "
        f"{r['update_us_median']:.1f} + schedule {r['schedule_us_median']:.1f} + encode "
        f"{r['encode_us_median']:.1f}), min {r['step_us_min']:.1f}, p90 {r['step_us_p90']:.1f},"
        f" max {r['step_us_max']:.1f}; after_plan {r['after_plan_us_median']:.1f}",
        flush=True,
    )
    return r


def _compare(n: int, args: argparse.Namespace, scenario: str) -> dict[str, object]:
    """Interleaved rounds of the modes in `--prefix-caching` order: the median of each mode's
    round medians."""
    rounds: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(args.repeats):
        for mode in args.prefix_caching.split(","):
            rounds[mode].append(_run(n, args, scenario, mode == "on")["step_us_median"])
    on, off = statistics.median(rounds["on"]), statistics.median(rounds["off"])
    print(f"N={n:5d} {scenario:6s} caching on/off step median {on:.1f}/{off:.1f} us = "
          f"{on / off:.3f}", flush=True)  # fmt: skip
    return {"running": n, "scenario": scenario, "on_us": on, "off_us": off,
            "ratio_on_off": on / off, "rounds": rounds}  # fmt: skip


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    modes = args.prefix_caching.split(",")
    results: list[dict[str, object]] = []
    for n in (int(x) for x in args.running.split(",")):
        for scenario in ("decode", "mixed"):
            if len(modes) > 1:
                results.append(_compare(n, args, scenario))
            else:
                r = _run(n, args, scenario, modes[0] == "on")
                results.append({"running": n, "scenario": scenario, **r})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"args": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
