"""Prefix caching on vs off, end to end, measured side by side in one run.

    PYTHONPATH=. .venv/bin/python bench/prefix_cache_bench.py --out results/prefix_cache
    PYTHONPATH=. .venv/bin/python bench/prefix_cache_bench.py --worker sim --sim-device h200 \\
        --sim-model llama-3-8b --out results/prefix_cache_h200

For each of `--repeats` rounds and each mode (caching on, then off) it starts one engine
(conveyor.launcher.LocalStack; only `--enable-prefix-caching` differs), and runs every scenario
on it, emptying the prefix cache first (`reset_prefix_cache`) so each run starts cold:

* shared-prefix: `--num-prompts` requests at once, a `--prefix-len`-token shared prefix and
  `--suffix-len`-token distinct suffixes, `--output-len` tokens out (EOS ignored);
* multi-turn: `--conversations` x `--num-turns` requests, each turn resending its history after
  a `--system-len`-token system prompt, at most one request per conversation in flight; the
  replies in that history are drawn in advance (conveyor bench's multi-turn workload), so a turn
  can reuse its previous turn's prompt but never its reply;
* chat: the same conversations as a chat client holds them: each turn resends the system
  prompt, the earlier user turns and the replies the engine actually gave, plus a new
  `--turn-len`-token user message (a turn can reuse its whole history). Before each turn, the
  first too, its user thinks for an exponentially drawn time of mean `--think-time` seconds
  (seeded), as vLLM's multi-turn benchmark lets its clients sleep a Poisson interval between
  requests; `--think-time 0` starts every conversation at once and sends each turn the moment
  the previous reply ends, which keeps identical conversations in lock-step (every turn arrives
  in a burst with the other conversations' turns);
* no-sharing: random distinct prompts (0% hits), to show what caching costs when it cannot help.

Engine configuration (the same for both modes): with the real worker the scheduler's defaults
(sized for a CPU: 32 running, a 256-token step budget); with `--worker sim` an H200-sized one,
256 running and a 4,096-token step budget (near vLLM's GPU defaults), the KV pool sized from the
device's memory. `--max-num-seqs` / `--max-num-batched-tokens` override either.

Prints mean TTFT (by turn for chat; split into arrival -> first plan -> first token), output
throughput, the hit rate and the scheduler's median result -> next plan gap (the step log's
`gap_s`) per scenario and mode, and the on/off ratios (median over rounds); writes everything to
<out>/prefix_cache.json. Run it alone: end-to-end timings on a shared machine swing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from conveyor.bench.arrivals import ArrivalConfig
from conveyor.bench.backends import ConveyorBackend, SamplingChoice
from conveyor.bench.metrics import RequestTrace, compute_metrics
from conveyor.bench.runner import run_workload
from conveyor.bench.steplog import engine_view, read_rid_map, read_step_log, request_spans
from conveyor.bench.workloads import WorkloadConfig, generate
from conveyor.launcher import LocalStack, StackSettings
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.sim.config import SimConfig
from shared.client import AsyncClient, Client, EngineError
from shared.config_flags import parse_size


@dataclass(frozen=True)
class Scenario:
    name: str
    workload: WorkloadConfig
    max_concurrency: Optional[int]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=("model", "sim"), default="model")
    p.add_argument("--sim-device", default="h200")
    p.add_argument("--sim-model", default="llama-3-8b")
    p.add_argument("--dtype", default="float32", help="real worker dtype")
    p.add_argument("--kv-cache-memory", default="2GiB", help="real worker KV cache")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--turn-len", type=int, default=64, help="multi-turn: tokens per user turn")
    p.add_argument("--think-time", type=float, default=2.0, help="chat: a user's mean think "
                   "time (s, exponential) before each turn; 0: lock-step")  # fmt: skip
    p.add_argument("--scenarios", default="shared-prefix,multi-turn,chat,no-sharing")
    p.add_argument("--max-num-seqs", type=int,
                   help="default: the scheduler's with the real worker, 256 sim")  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=int, help="step budget, also the chunk "
                   "size; default: the scheduler's with the real worker, 4096 sim")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("results/prefix_cache"))
    return p.parse_args(argv)


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    # one workload for both conversation scenarios: "chat" only sizes its turns from it
    multi_turn = WorkloadConfig(
        name="multi-turn",
        num_prompts=args.conversations * args.num_turns,
        num_turns=args.num_turns,
        input_len=args.turn_len,
        output_len=args.output_len,
        prefix_len=args.system_len,
    )
    all_ = {
        "shared-prefix": Scenario(
            "shared-prefix",
            WorkloadConfig(
                name="shared-prefix",
                num_prompts=args.num_prompts,
                input_len=args.suffix_len,
                output_len=args.output_len,
                prefix_len=args.prefix_len,
            ),
            None,
        ),
        "multi-turn": Scenario(
            "multi-turn",
            multi_turn,
            args.conversations,
        ),
        "chat": Scenario(  # the workload only sizes it: _chat() draws and sends the turns
            "chat",
            multi_turn,
            args.conversations,
        ),
        "no-sharing": Scenario(
            "no-sharing",
            WorkloadConfig(
                name="uniform",
                num_prompts=args.num_prompts,
                input_len=args.suffix_len + args.prefix_len // 4,
                output_len=args.output_len,
            ),
            None,
        ),
    }
    return [all_[name] for name in args.scenarios.split(",")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# the simulated (H200-class) device's engine configuration, see the module docstring
SIM_MAX_NUM_SEQS = 256
SIM_MAX_NUM_BATCHED_TOKENS = 4096


def engine_flags(args: argparse.Namespace) -> dict[str, str]:
    """Scheduler flags both modes share (the engine's size; empty: the scheduler's defaults)."""
    seqs, budget = args.max_num_seqs, args.max_num_batched_tokens
    if args.worker == "sim":
        seqs = SIM_MAX_NUM_SEQS if seqs is None else seqs
        budget = SIM_MAX_NUM_BATCHED_TOKENS if budget is None else budget
    flags = {} if seqs is None else {"max_num_seqs": str(seqs)}
    if budget is not None:
        flags.update(max_num_batched_tokens=str(budget), chunk_size=str(budget))
    return flags


def _stack(args: argparse.Namespace, caching: bool, log_dir: Path) -> LocalStack:
    worker = WorkerConfig(dtype=args.dtype, kv_cache_memory=parse_size(args.kv_cache_memory))
    return LocalStack(
        StackSettings(
            worker=args.worker,
            sim_config=SimConfig(device=args.sim_device, model=args.sim_model),
            frontend_address=f"tcp://127.0.0.1:{_free_port()}",
            scheduler_config=SchedulerConfig(
                **{name: int(value) for name, value in engine_flags(args).items()},
                enable_prefix_caching=caching,
            ),
            worker_config=worker,
            gateway=False,
            log_dir=log_dir,
        )
    )


async def _chat(
    address: str, cfg: WorkloadConfig, id_prefix: str, think_time_s: float
) -> tuple[list[Any], float]:
    """The chat scenario: `cfg.num_prompts / cfg.num_turns` conversations, each sending its
    next turn a think time (exponential, mean `think_time_s`; none when 0) after the previous
    reply has ended, with that reply (its actual token ids) in the history. Returns the traces
    and the run's duration (s, think times included)."""
    rng = random.Random(20261201)
    think_rng = random.Random(20261202)  # its own stream: the prompts do not depend on it
    vocab = (100, cfg.vocab_size - 1)  # plain tokens, as conveyor.bench.workloads draws them
    system = [rng.randint(*vocab) for _ in range(cfg.prefix_len)]
    num_convs = cfg.num_prompts // cfg.num_turns
    traces: list[RequestTrace] = []
    client = AsyncClient(address=address, timeout=600.0)

    async def turn(index: int, prompt: list[int]) -> tuple[RequestTrace, list[int]]:
        start_wall, start = time.time(), time.perf_counter()
        times: list[float] = []
        out: list[int] = []
        rid = f"{id_prefix}-{index}"
        stream = client.stream(
            prompt_token_ids=prompt, request_id=rid, max_tokens=cfg.output_len,
            temperature=0.0, ignore_eos=True,
        )  # fmt: skip
        try:
            async for chunk in stream:
                if chunk.token_ids:
                    times.append(time.perf_counter())
                    out.extend(chunk.token_ids)
        except EngineError as exc:
            return RequestTrace(index, len(prompt), False, error=str(exc), rid=rid), out
        itls = tuple(b - a for a, b in zip(times, times[1:], strict=False))
        trace = RequestTrace(index, len(prompt), bool(out), len(out), start_wall,
                             times[0] - start if out else None, times[-1] - start if out else None,
                             itls, "" if out else "no output", rid)  # fmt: skip
        return trace, out

    async def conversation(conv: int, think_s: list[float]) -> None:
        history = list(system)
        user_rng = random.Random(20261201 * 1000 + conv)  # its own messages, seeded
        for t in range(cfg.num_turns):
            prompt = history + [user_rng.randint(*vocab) for _ in range(cfg.input_len)]
            if think_s[t] > 0:
                await asyncio.sleep(think_s[t])
            trace, reply = await turn(conv * cfg.num_turns + t, prompt)
            traces.append(trace)
            if not trace.success:
                return
            history = prompt + reply

    thinks = _think_times(think_rng, think_time_s, num_convs, cfg.num_turns)
    start = time.perf_counter()
    try:
        await asyncio.gather(*(conversation(c, thinks[c]) for c in range(num_convs)))
    finally:
        await client.close()
    return traces, time.perf_counter() - start


def _think_times(
    rng: random.Random, mean_s: float, num_convs: int, num_turns: int
) -> list[list[float]]:
    """Each conversation's think time before each turn (exponential, mean `mean_s`; 0: none)."""
    return [
        [rng.expovariate(1.0 / mean_s) if mean_s > 0 else 0.0 for _ in range(num_turns)]
        for _ in range(num_convs)
    ]


def _ttft_by_turn_ms(traces: list[RequestTrace], num_turns: int) -> list[float]:
    """Mean TTFT (ms) of each turn of the chat scenario's conversations (index = conversation
    x num_turns + turn); a turn no request reached counts 0."""
    by_turn: list[list[float]] = [[] for _ in range(num_turns)]
    for t in traces:
        if t.ttft is not None:
            by_turn[t.index % num_turns].append(t.ttft * 1e3)
    return [statistics.mean(v) if v else 0.0 for v in by_turn]


def _from_step_log(log_dir: Path, traces: list[RequestTrace], since: float) -> dict[str, Any]:
    """What the scheduler's step log says of the steps planned since `since`: their median
    result -> next plan gap (`gap_s`: the scheduler's cost per step as the server runs it, µs),
    and where the requests' TTFT went (`ttft_split`): mean seconds from arrival (the client's
    send) to the first plan that holds the request (`wait_s`), from there to the result that
    carries its first token (`prefill_s`), and the steps its prompt took (`prefill_steps`)."""
    steps = read_step_log(log_dir / "scheduler.log", since=since)
    gaps = [s.gap_s * 1e6 for s in steps if s.gap_s is not None]
    arrivals, _ = engine_view(steps, traces, read_rid_map(log_dir))
    spans = [s for s in request_spans(steps, arrivals) if s.rid in arrivals and s.prefill]
    split = {"wait_s": 0.0, "prefill_s": 0.0, "prefill_steps": 0.0}
    if spans:
        split = {
            "wait_s": statistics.mean(s.prefill[0][0] - s.arrival for s in spans),
            "prefill_s": statistics.mean(s.prefill[-1][1] - s.prefill[0][0] for s in spans),
            "prefill_steps": statistics.mean(len(s.prefill) for s in spans),
        }
    return {"median_gap_us": statistics.median(gaps) if gaps else 0.0, "ttft_split": split}


def _run(address: str, scenario: Scenario, log_dir: Path, think_time_s: float) -> dict[str, Any]:
    """One cold run of a scenario on a running engine: metrics and the engine's hit rate."""
    with Client(address, timeout=600.0) as client:
        # a short unrelated request first (first-use costs), then a cold cache
        client.generate(prompt_token_ids=[101 + i for i in range(24)], max_tokens=2)
        client.reset_prefix_cache()
        before = client.stats()["engine"]
    since = time.time()
    requests = generate(scenario.workload)
    arrivals = ArrivalConfig(max_concurrency=scenario.max_concurrency)
    sampling = SamplingChoice(temperature=0.0, ignore_eos=True)

    async def go() -> Any:
        backend = ConveyorBackend(address, id_prefix=f"pc-{uuid.uuid4().hex[:8]}")
        try:
            return await run_workload(backend, requests, arrivals, sampling, None)
        finally:
            await backend.aclose()

    if scenario.name == "chat":
        prefix = f"pc-{uuid.uuid4().hex[:8]}"
        traces, duration = asyncio.run(_chat(address, scenario.workload, prefix, think_time_s))
    else:
        outcome = asyncio.run(go())
        traces, duration = outcome.traces, outcome.duration_s
    metrics = compute_metrics(traces, duration)
    if scenario.name == "chat":
        metrics["mean_ttft_ms_by_turn"] = _ttft_by_turn_ms(traces, scenario.workload.num_turns)
    with Client(address, timeout=60.0) as client:
        after = client.stats()["engine"]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    metrics["hit_rate"] = hits / queries if queries else 0.0
    metrics["prefill_tokens"] = after["num_prefill_tokens"] - before["num_prefill_tokens"]
    metrics["kv_blocks_total"] = after["kv_blocks_total"]
    metrics.update(_from_step_log(log_dir, traces, since))
    return metrics


def _print_run(r: int, name: str, mode: str, m: dict[str, Any]) -> None:
    """One round's figures of one scenario and mode."""
    print(
        f"round {r} {name:13s} caching {mode:3s}: mean TTFT "
        f"{m['mean_ttft_ms']:9.1f} ms, output {m['output_throughput']:8.1f} tok/s,"
        f" hit rate {m['hit_rate']:.3f}, prefill tokens {m['prefill_tokens']:.0f},"
        f" median gap {m['median_gap_us']:.0f} us",
        flush=True,
    )
    split = m["ttft_split"]
    print(
        f"  TTFT split: {split['wait_s'] * 1e3:.0f} ms to the first plan, then "
        f"{split['prefill_s'] * 1e3:.0f} ms to the first token "
        f"({split['prefill_steps']:.2f} prefill steps)",
        flush=True,
    )
    if "mean_ttft_ms_by_turn" in m:
        turns = [round(x) for x in m["mean_ttft_ms_by_turn"]]
        print(f"  mean TTFT by turn (ms): {turns}", flush=True)


def _summarize(name: str, modes: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The medians over rounds of each mode, and the on/off ratios (printed)."""
    med = {
        mode: {k: statistics.median(m[k] for m in ms) for k in ("mean_ttft_ms",
               "output_throughput", "hit_rate", "prefill_tokens", "duration",
               "median_gap_us")}
        for mode, ms in modes.items()
    }  # fmt: skip
    ttft_x = med["off"]["mean_ttft_ms"] / med["on"]["mean_ttft_ms"]
    tput_x = med["on"]["output_throughput"] / med["off"]["output_throughput"]
    gap_x = med["on"]["median_gap_us"] / max(med["off"]["median_gap_us"], 1e-9)
    print(
        f"{name:13s}: mean TTFT off/on = {ttft_x:.2f}x, output throughput on/off = "
        f"{tput_x:.2f}x, scheduler gap on/off = {gap_x:.2f}x "
        f"(hit rate on {med['on']['hit_rate']:.3f})",
        flush=True,
    )
    return {**med, "ttft_off_over_on": ttft_x, "throughput_on_over_off": tput_x,
            "gap_on_over_off": gap_x}  # fmt: skip


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    plan = scenarios(args)
    print(f"engine: {engine_flags(args) or 'the scheduler defaults'}", flush=True)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s.name: {"on": [], "off": []} for s in plan}
    for r in range(args.repeats):
        for mode in ("on", "off"):
            log_dir = Path(tempfile.mkdtemp(prefix=f"prefix-cache-{mode}-"))
            stack = _stack(args, mode == "on", log_dir)
            stack.start()
            try:
                stack.wait_ready(timeout=600.0)
                for s in plan:
                    m = _run(stack.frontend_address, s, log_dir, args.think_time)
                    if m["failed"]:
                        raise SystemExit(f"{s.name} caching {mode}: {m['failed']} requests failed")
                    runs[s.name][mode].append(m)
                    _print_run(r, s.name, mode, m)
            finally:
                stack.stop()
    summary = {name: _summarize(name, modes) for name, modes in runs.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: str(v) for k, v in vars(args).items()}
    meta["engine_flags"] = str(engine_flags(args))
    path = args.out / "prefix_cache.json"
    path.write_text(json.dumps({"args": meta, "summary": summary, "runs": runs}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
