"""The scheduler's own cost per step, result frame to plan frame, with no worker and no sockets.

    PYTHONPATH=. .venv/bin/python bench/scheduler_bench.py --running 256,1024 --steps 200

For each N it fills the batch with N requests of `--context` tokens (block size 16), runs them
until all N are decoding, then times `--steps` steps of pure decode, and again `--steps` mixed
steps in which a new `--context`-token prompt is prefilled in `--chunk`-token chunks beside the N
decodes. Timed per step, as the server runs them between a result and the next plan: decoding
the result frame, `update()`, `schedule()`, encoding the plan frame. The "worker" answers
instantly with a fixed token; building and encoding its answer is not timed.
Goal: <= 200 us per step at 256 running. Run it on a quiet machine only (not while tests or
other benchmarks run); docs/PERFORMANCE.md and docs/design/scheduler.md cite its figures.
Writes JSON to --out.

Every prompt is distinct (no shared prefix: 0% prefix-cache hits), and sampled tokens differ
per request, so prefix caching costs here what it costs a workload it cannot help.
`--prefix-caching on,off` times each scenario with caching on and off: in each of `--repeats`
rounds one scheduler per mode, stepped in pairs (paired steps see the same moments of a shared
machine; which mode goes first in a pair is drawn at random, seeded: the second of a pair runs
measurably slower, and strict alternation aliases with the mixed scenario's 4-step period, so
one mode always went first on the same kinds of step); it reports the median over rounds of the
on/off ratio of median step times, of the median per-step ratio and of the order-balanced
ratio (see `_compare`). `after_plan` (the registrations and evictions ahead the server runs
off the result -> plan path, while the worker computes) is timed apart, as
`after_plan_us_median` and `_mean` (the predictor's refit shows in the mean only).
`--sampled-shapes on,off` compares the step-time predictor learning from 1 step in 16 (the
default without slo or speculation) and from every step (the worker reports modelled times).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import random
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Optional

from bench.trace_sink import sink_tracing
from services.scheduler import Scheduler, SchedulerConfig
from services.scheduler.tracing import SchedulerTrace
from services.worker.held_batch import HeldBatch
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
    p.add_argument(
        "--tracing",
        default="off",
        help="on | off | on,off (compared as --prefix-caching is, "
        "caching on): requests traced, spans exported to a sink in this process",
    )
    p.add_argument(
        "--sampled-shapes",
        default="on",
        help="on | off | on,off (compared as --prefix-caching is, caching on): the step-time "
        "predictor learns from 1 step in 16 (on) or from every step (off)",
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds of on,off when comparing")
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of timing: cProfile each mode's timed parts, print the top functions by "
        "own time and the largest differences between the modes",
    )
    return p.parse_args(argv)


class _Worker:
    """The worker's side (not timed): its persistent batch (worker/held_batch.py) applies each
    plan; each sampled token differs per request and step (decode-filled blocks never match)."""

    def __init__(self, sched: Scheduler, traceparent: Optional[str] = None) -> None:
        self.held = HeldBatch(sched.pool.num_blocks, sched.block_size, sched.max_model_len)
        self.traceparent = traceparent  # of the requests the bench submits (tracing on)

    def answer(self, plan: StepPlan) -> StepResult:
        sampled = self.held.apply(plan).sampled()
        base = plan.step_id * 7919
        tokens = [(base + i) % VOCAB for i in range(len(sampled))]
        self.held.record_samples(sampled, tokens)
        forward_s = 0.005 + 2e-6 * plan.num_scheduled_tokens + 1e-5 * plan.num_seqs  # modelled
        return StepResult(plan.step_id, tokens, forward_s=forward_s)  # in batch order: no rids


def _submit(
    rid: str, prompt_len: int, max_tokens: int, traceparent: Optional[str] = None
) -> SubmitRequest:
    """A prompt no other request shares (its first token differs)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    first = zlib.crc32(rid.encode()) % VOCAB
    prompt = [(first + i) % VOCAB for i in range(prompt_len)]
    return SubmitRequest(rid, prompt, sampling, traceparent=traceparent)


def _warm_up(n: int, args: argparse.Namespace, steps: int, caching: bool = True,
             traced: bool = False, sampled: bool = True) -> tuple[Scheduler, _Worker]:  # fmt: skip
    """N requests whose prompt is `context - 1` tokens, prefilled and decoding (`traced`: each
    with a traceparent, the scheduler's spans exported; `sampled`: the step-time predictor
    learns from 1 step in 16, else from every step)."""
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
    trace = SchedulerTrace(sink_tracing()) if traced else None
    sched = Scheduler(config, num_blocks, bs, 16 * args.context, [-1], cache_namespace=b"bench",
                      trace=trace, shape_every=None if sampled else 1)  # fmt: skip
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" if traced else None
    for i in range(n):
        sched.add_request(_submit(f"req-{i:05d}", args.context - 1, 1 << 20, tp))
    worker = _Worker(sched, tp)
    while True:
        plan = sched.schedule()
        flight = sched.in_flight.newest()
        assert plan is not None and flight is not None
        sched.update(worker.answer(plan))
        rec = flight.record
        if not any(rec.is_prefill) and len(rec.rids) == n:
            return sched, worker


class _Stepper:
    """Runs one scheduler step by step, timing its part of each step as the server runs it
    between a result frame and the next plan frame: decode the result, update(), schedule(),
    encode the plan. With `new_prompt_len`, a new prompt arrives as soon as the previous one is
    done (so every step holds a prefill chunk)."""

    def __init__(
        self,
        sched: Scheduler,
        worker: _Worker,
        new_prompt_len: int,
        profiler: Optional[cProfile.Profile] = None,
    ) -> None:
        """`profiler`: enabled during the timed parts only (`--profile`)."""
        self.sched = sched
        self.worker = worker
        self.new_prompt_len = new_prompt_len
        self.profiler = profiler
        self.parts: dict[str, list[float]] = {"decode": [], "update": [], "schedule": [],
                                              "encode": []}  # fmt: skip
        self.after: list[float] = []
        self.arrivals = 0
        plan = sched.schedule()
        assert plan is not None
        self.plan = plan

    def step(self) -> float:
        """One step; its time (us), after_plan excluded."""
        sched, parts, prof = self.sched, self.parts, self.profiler
        frame = encode(self.worker.answer(self.plan))  # the worker's side: not timed
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        result = decode(frame)
        t1 = time.perf_counter()
        sched.update(result)
        t2 = time.perf_counter()
        if prof is not None:
            prof.disable()
        if self.new_prompt_len and (
            self.arrivals == 0 or not sched.is_live(f"new-{self.arrivals:05d}")
        ):
            self.arrivals += 1
            rid, tp = f"new-{self.arrivals:05d}", self.worker.traceparent
            sched.add_request(_submit(rid, self.new_prompt_len, 1, tp))
        if prof is not None:
            prof.enable()
        t3 = time.perf_counter()
        plan = sched.schedule()
        t4 = time.perf_counter()
        assert plan is not None
        encode(plan)
        t5 = time.perf_counter()
        if prof is not None:
            prof.disable()
        sched.after_plan()  # the server runs it while the worker computes: timed apart
        self.after.append((time.perf_counter() - t5) * 1e6)
        self.plan = plan
        for name, a, b in (("decode", t0, t1), ("update", t1, t2), ("schedule", t3, t4),
                           ("encode", t4, t5)):  # fmt: skip
            parts[name].append((b - a) * 1e6)
        return (t2 - t0 + t5 - t3) * 1e6

    def summary(self) -> dict[str, float]:
        total = [sum(p) for p in zip(*self.parts.values(), strict=True)]
        out = {f"{name}_us_median": statistics.median(v) for name, v in self.parts.items()}
        out.update(
            after_plan_us_median=statistics.median(self.after),
            after_plan_us_mean=statistics.mean(self.after),
            step_us_median=statistics.median(total),
            step_us_min=min(total),  # the least disturbed step: best guess on a shared machine
            step_us_p90=sorted(total)[int(0.9 * (len(total) - 1))],
            step_us_max=max(total),
        )
        return out


def _time_steps(
    sched: Scheduler, worker: _Worker, steps: int, new_prompt_len: int
) -> dict[str, float]:
    """`steps` timed steps of one scheduler (see _Stepper)."""
    gc.collect()
    stepper = _Stepper(sched, worker, new_prompt_len)
    for _ in range(steps):
        stepper.step()
    return stepper.summary()


def _run(n: int, args: argparse.Namespace, scenario: str, caching: bool) -> dict[str, float]:
    sched, worker = _warm_up(n, args, args.steps, caching)
    r = _time_steps(sched, worker, args.steps, args.context if scenario == "mixed" else 0)
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
    """`--repeats` rounds; in each, one scheduler per mode (same requests), stepped in pairs
    so both see the same moments of a shared machine. The first mode of a pair is drawn at
    random (seeded by the round): the second of a pair ran ~2-3% slower here, and alternating
    by step parity put one mode first on every step of one kind in the mixed scenario (its
    pattern repeats every 4 steps), which biased both medians. Per round: the ratio of the
    modes' median step times, and the median of the per-step ratios (step i of one mode
    against step i of the other: the same work), also split by which mode went first.
    Reported: the median over rounds of each, and of the order-balanced ratio, the geometric
    mean of the two split medians: the second of a pair runs slower by a factor that grows with
    the working set (~1% at 256 running, up to ~15% at 1,024, where the per-step ratios form
    two clusters and their median moves with how many steps each order drew); a factor that
    slows either mode alike cancels in the product."""
    knob = _compared(args)
    modes = getattr(args, knob).split(",")
    new_len = args.context if scenario == "mixed" else 0
    rounds: dict[str, list[float]] = {m: [] for m in modes}
    ratios: list[float] = []
    paired: list[float] = []
    balanced: list[float] = []
    for r in range(args.repeats):
        steppers = {m: _Stepper(*_warm_up(n, args, args.steps, **_mode(knob, m)), new_len)
                    for m in modes}  # fmt: skip
        gc.collect()
        times: dict[str, list[float]] = {m: [] for m in modes}
        rng = random.Random(r)
        on_first: list[bool] = []
        for _ in range(args.steps):
            order = modes if rng.random() < 0.5 else modes[::-1]
            on_first.append(order[0] == "on")
            for m in order:
                times[m].append(steppers[m].step())
        meds = {m: steppers[m].summary()["step_us_median"] for m in modes}
        for m in modes:
            rounds[m].append(meds[m])
        ratios.append(meds["on"] / meds["off"])
        step_ratios = [a / b for a, b in zip(times["on"], times["off"], strict=True)]
        paired.append(statistics.median(step_ratios))
        split = [
            statistics.median(
                [x for x, f in zip(step_ratios, on_first, strict=True) if f == o] or [math.nan]
            )
            for o in (True, False)
        ]
        balanced.append(math.sqrt(split[0] * split[1]))  # nan if one order never came up
        parts = {m: {k: round(v, 1) for k, v in steppers[m].summary().items()} for m in modes}
        print(f"N={n:5d} {scenario:6s} round: on/off {meds['on']:.1f}/{meds['off']:.1f} us = "
              f"{ratios[-1]:.3f}, paired {paired[-1]:.3f} (on first {split[0]:.3f}, second "
              f"{split[1]:.3f}, balanced {balanced[-1]:.3f}); parts {parts}",
              flush=True)  # fmt: skip
    ratio, pair = statistics.median(ratios), statistics.median(paired)
    bal = statistics.median(balanced)
    on, off = statistics.median(rounds["on"]), statistics.median(rounds["off"])
    print(f"N={n:5d} {scenario:6s} {knob} on/off step median {on:.1f}/{off:.1f} us: ratio "
          f"{ratio:.3f}, paired {pair:.3f}, balanced {bal:.3f} (median of {args.repeats} "
          "rounds)", flush=True)  # fmt: skip
    return {"running": n, "scenario": scenario, "compared": knob, "on_us": on, "off_us": off,
            "ratio_on_off": ratio, "paired_ratio_on_off": pair, "balanced_ratio_on_off": bal,
            "rounds": rounds, "round_ratios": ratios, "round_paired_ratios": paired,
            "round_balanced_ratios": balanced}  # fmt: skip


def _compared(args: argparse.Namespace) -> str:
    """The knob given two modes (prefix caching unless another one is)."""
    for knob in ("tracing", "sampled_shapes"):
        if "," in getattr(args, knob):
            return knob
    return "prefix_caching"


def _mode(knob: str, mode: str) -> dict[str, bool]:
    """_warm_up's keywords for one mode of the compared knob (caching stays on when another
    knob is compared)."""
    if knob == "tracing":
        return {"caching": True, "traced": mode == "on"}
    if knob == "sampled_shapes":
        return {"caching": True, "sampled": mode == "on"}
    return {"caching": mode == "on"}


def _profile(args: argparse.Namespace) -> None:
    """cProfile the timed parts of each scenario's steps (result decode, update(), schedule(),
    plan encode; not the worker's answer, arrivals or after_plan), one scheduler per mode
    stepped in turn as in the timed runs. Prints each mode's top functions by own time and,
    with two modes, the functions whose own time per step differs most between them (where the
    on/off difference goes: call counts are exact, times inflated by the profiler)."""
    import pstats

    modes = args.prefix_caching.split(",")
    for n in (int(x) for x in args.running.split(",")):
        for scenario in ("decode", "mixed"):
            new_len = args.context if scenario == "mixed" else 0
            profs = {m: cProfile.Profile() for m in modes}
            steppers = {m: _Stepper(*_warm_up(n, args, args.steps, m == "on"), new_len, profs[m])
                        for m in modes}  # fmt: skip
            for _ in range(args.steps):
                for m in modes:
                    steppers[m].step()
            own: dict[str, dict[str, tuple[int, float]]] = {}
            for m in modes:
                print(f"==== N={n} {scenario} caching {m}: timed parts only", flush=True)
                stats = pstats.Stats(profs[m])
                stats.sort_stats("tottime").print_stats(15)
                rows = stats.stats.items()  # type: ignore[attr-defined]  # (file, line, fn) -> row
                own[m] = {f"{path.split('/')[-1]}:{line}({name})": (row[1], row[2])
                          for (path, line, name), row in rows}  # fmt: skip
            if len(modes) == 2:
                _print_profile_diff(own, modes, args.steps)


def _print_profile_diff(
    own: dict[str, dict[str, tuple[int, float]]], modes: list[str], steps: int
) -> None:
    """The functions whose own time per step differs most between the two modes."""
    a, b = modes
    rows = []
    for fn in own[a].keys() | own[b].keys():
        (ca, ta), (cb, tb) = own[a].get(fn, (0, 0.0)), own[b].get(fn, (0, 0.0))
        rows.append(((ta - tb) * 1e6 / steps, fn, ca, cb))
    rows.sort(key=lambda r: -abs(r[0]))
    print(f"==== own time per step, {a} - {b} (us; calls {a} / {b}):")
    for diff, fn, ca, cb in rows[:16]:
        print(f"{diff:+8.2f}  {fn:70s} {ca:7d} / {cb:7d}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.profile:
        _profile(args)
        return 0
    modes = args.prefix_caching.split(",")
    results: list[dict[str, object]] = []
    for n in (int(x) for x in args.running.split(",")):
        for scenario in ("decode", "mixed"):
            if len(modes) > 1 or _compared(args) != "prefix_caching":
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
