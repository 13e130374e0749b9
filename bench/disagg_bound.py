"""How far can prefill/decode disaggregation beat colocated engines in the cost model? A map
by formula, no engines run (issue 32; docs/lab/2026-12-disagg-bound.md).

    PYTHONPATH=. .venv/bin/python bench/disagg_bound.py --devices 8,16 \
        --input-lens 1024,2048,4096,8192 --output-lens 128,512,1024

For each model, device count, prompt and output length: the most requests/s at which
`--attainment` (90%) of requests meet the TTFT target while every step stays within the TPOT
target, for
* colocated engines (data parallel, tensor parallel size t): mixed steps, each holding the
  running decodes and the largest chunk of the oldest waiting prompt that keeps the step within
  the TPOT target. The decodes in flight follow Little's law (B = rate x output x mean step);
  prompts are chunked one after another, so a prompt's prefill takes ceil(p / chunk) steps;
* P:D layouts (P prefill engines of t_p devices, D decode engines of t_d): a prompt takes its
  chunked prefill (chunks of --prefill-chunk) on a prefill engine plus the KV hand-over over
  --kv-link; a decode engine holds the most rows whose pure-decode step fits the TPOT target
  and its KV pool.
Both sides' prompt queues are simulated the same way (Poisson arrivals, common random numbers,
first-free engine among the side's prefilling engines: the router's least-loaded pick), and the
rate searched is the highest that keeps the attainment. Where the formula is kinder to one
side it is to P:D: its decode rows never wait on a pull and its TPOT is the step's, unjittered.
Every figure is the cost model's (docs/simulator.md), not a GPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import numpy as np

from services.worker.sim.config import SimConfig
from services.worker.sim.cost_model import step_cost, step_work
from services.worker.sim.kv_link import KV_LINKS, SimKvPool
from services.worker.sim.profiles import DeviceProfile, ModelShape
from services.worker.sim.runner import kv_capacity_blocks

BLOCK_SIZE = 16
NUM_ARRIVALS = 4000  # per queue simulation, after WARMUP
WARMUP = 400


@dataclass(frozen=True, slots=True)
class Load:
    """The workload and targets one point of the map is for."""

    input_len: int
    output_len: int
    ttft_s: float
    tpot_s: float
    share: float  # of requests that must meet the TTFT target (DistServe's attainment)

    @property
    def decode_ctx(self) -> int:
        """A decode row's cached tokens, on average over its output."""
        return self.input_len + self.output_len // 2


@dataclass(frozen=True, slots=True)
class Engine:
    """One engine: its device group and model, with the step costs the map asks for."""

    device: DeviceProfile
    model: ModelShape
    tp: int

    def step_s(self, num_decodes: int, decode_ctx: int, chunk: int, chunk_start: int) -> float:
        starts = [decode_ctx] * num_decodes + ([chunk_start] if chunk else [])
        tokens = [1] * num_decodes + ([chunk] if chunk else [])
        return step_cost(self.device, step_work(self.model, starts, tokens, len(tokens))).total_s

    def kv_tokens(self) -> int:
        return kv_capacity_blocks(self.device, self.model, BLOCK_SIZE) * BLOCK_SIZE


def make_engine(device: str, model: str, weight_dtype: str, tp: int) -> Optional[Engine]:
    """The engine as the simulated worker models it (SimConfig), or None when `tp` does not
    divide the model's heads or its weights leave no KV room on `tp` devices."""
    try:
        sim = SimConfig(device=device, model=model, weight_dtype=weight_dtype,
                        tensor_parallel_size=tp)  # fmt: skip
        engine = Engine(sim.device_profile(), sim.model_shape(), tp)
        return engine if engine.kv_tokens() > 0 else None
    except ValueError:  # SimConfig's or kv_capacity_blocks' reason: no such engine
        return None


def largest_chunk(engine: Engine, num_decodes: int, load: Load) -> int:
    """The most prompt tokens a step beside `num_decodes` decodes may compute within the TPOT
    target (0: none), the chunk taken half-way into the prompt."""
    lo, hi = 0, load.input_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if engine.step_s(num_decodes, load.decode_ctx, mid, load.input_len // 2) <= load.tpot_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def ttft_quantile(rate: float, num_servers: int, service_s: float, share: float) -> float:
    """The TTFT that `share` of Poisson arrivals at `rate` meet, served by `num_servers`
    first-free servers of a fixed service time (the same random draws at every rate)."""
    gaps = np.random.default_rng(0).exponential(1.0, NUM_ARRIVALS + WARMUP) / rate
    free = [0.0] * num_servers
    now, waits = 0.0, []
    for gap in gaps:
        now += gap
        start = max(now, heapq.heappop(free))
        heapq.heappush(free, start + service_s)
        waits.append(start - now)
    return float(np.quantile(waits[WARMUP:], share)) + service_s


def colocated_at(engine: Engine, rate: float, load: Load) -> Optional[tuple[float, int, int]]:
    """(prefill seconds a prompt, decodes, chunk) of one colocated engine at `rate` req/s, or
    None when its steps cannot keep the TPOT target or its KV pool: Little's law, iterated."""
    step = engine.step_s(1, load.decode_ctx, 0, 0)
    for _ in range(20):
        decodes = max(1, math.ceil(rate * load.output_len * step))
        if decodes * (load.input_len + load.output_len) > engine.kv_tokens():
            return None
        chunk = largest_chunk(engine, decodes, load)
        if chunk == 0:
            return None
        steps = math.ceil(load.input_len / chunk)
        full = engine.step_s(decodes, load.decode_ctx, chunk, load.input_len // 2)
        busy = min(1.0, rate * steps * full)  # share of steps that carry a chunk
        step = busy * full + (1 - busy) * engine.step_s(decodes, load.decode_ctx, 0, 0)
    return steps * full, decodes, chunk


def best_rate(meets: Callable[[float], bool]) -> float:
    """The highest rate that `meets` accepts (0.0 when none), to 1%: doubled, then bisected."""
    lo, hi = 0.0, 0.01
    while meets(hi) and hi < 1e5:
        lo, hi = hi, 2 * hi
    while hi - lo > 0.01 * hi and hi > 1e-4:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def colocated_rate(engine: Engine, num_engines: int, load: Load) -> tuple[float, str]:
    def meets(rate: float) -> bool:
        one = colocated_at(engine, rate / num_engines, load)
        return (
            one is not None and ttft_quantile(rate, num_engines, one[0], load.share) <= load.ttft_s
        )

    rate = best_rate(meets)
    one = colocated_at(engine, rate / num_engines, load) if rate else None
    how = f"B {one[1]}, chunk {one[2]}, prefill {one[0]:.2f} s" if one else "-"
    return rate, how


def prefill_seconds(engine: Engine, load: Load, chunk: int) -> float:
    starts = range(0, load.input_len, chunk)
    return sum(engine.step_s(0, 0, min(chunk, load.input_len - s), s) for s in starts)


def decode_rows(engine: Engine, load: Load) -> int:
    """The most decode rows whose step fits the TPOT target and whose KV fits the pool."""
    lo, hi = 0, engine.kv_tokens() // (load.input_len + load.output_len)
    while lo < hi:  # a step's time grows with its rows
        mid = (lo + hi + 1) // 2
        lo, hi = (
            (mid, hi) if engine.step_s(mid, load.decode_ctx, 0, 0) <= load.tpot_s else (lo, mid - 1)
        )
    return lo


def handover_s(pre: Engine, dec: Engine, load: Load, link: str) -> float:
    """A prompt's hand-over as the simulated decode worker lands it (sim/kv_link.py): its full
    blocks over the link, each rank moving its share, then the scatter."""
    pool = SimKvPool(dec.device, dec.model, BLOCK_SIZE, KV_LINKS[link], one_sided=True)
    num_blocks = load.input_len // BLOCK_SIZE  # the tail is recomputed on the decode side
    return pool.landing_seconds(
        num_blocks, [num_blocks, BLOCK_SIZE, dec.model.kv_bytes_per_token, pre.tp]
    )


def pd_rate(
    pre: Engine, p: int, dec: Engine, d: int, load: Load, args: argparse.Namespace
) -> tuple[float, str]:
    """P:D's rate: its prefill engines' TTFT queue, capped by its decode engines' rows (the
    hand-over comes after the first token, so it counts in TPOT, spread over the output)."""
    service = prefill_seconds(pre, load, args.prefill_chunk)
    handover = handover_s(pre, dec, load, args.kv_link)
    tpot = dataclasses.replace(load, tpot_s=load.tpot_s - handover / max(load.output_len - 1, 1))
    rows = decode_rows(dec, tpot)
    cap = d * rows / (load.output_len * dec.step_s(rows, load.decode_ctx, 0, 0)) if rows else 0.0
    rate = best_rate(lambda r: ttft_quantile(r, p, service, load.share) <= load.ttft_s)
    how = f"prefill {service:.2f} s, hand-over {handover * 1e3:.0f} ms, rows {rows}"
    return min(rate, cap), how


def layouts(
    num_devices: int, tp_sizes: list[int]
) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, int]]]:
    """Colocated (engines, tp) and P:D (P, tp_p, D, tp_d) on exactly `num_devices` devices."""
    sizes = [t for t in tp_sizes if t <= num_devices]
    colocated = [(num_devices // t, t) for t in sizes if num_devices % t == 0]
    pd = []
    for tp_p in sizes:
        for tp_d in sizes:
            for p in range(1, num_devices // tp_p + 1):
                rest = num_devices - p * tp_p
                if rest > 0 and rest % tp_d == 0:
                    pd.append((p, tp_p, rest // tp_d, tp_d))
    return colocated, pd


def point(model: str, num_devices: int, load: Load, args: argparse.Namespace) -> dict:
    """The best colocated and the best P:D layout at one point of the map."""
    engines = {t: make_engine(args.device, model, args.weight_dtype, t) for t in args.tp_sizes}
    colocated, pd = layouts(num_devices, args.tp_sizes)
    best_c = max(
        ((*colocated_rate(engines[t], n, load), f"dp{n}:tp{t}") for n, t in colocated
         if engines[t]), default=(0.0, "-", "-"))  # fmt: skip
    best_pd = max(
        ((*pd_rate(engines[a], p, engines[b], d, load, args), f"{p}:{d}:tp{a}-{b}")
         for p, a, d, b in pd if engines[a] and engines[b]), default=(0.0, "-", "-"))  # fmt: skip
    ratio = best_pd[0] / best_c[0] if best_c[0] > 0 else math.inf
    return {
        "model": model,
        "devices": num_devices,
        "input_len": load.input_len,
        "output_len": load.output_len,
        "colocated": best_c,
        "pd": best_pd,
        "ratio": ratio,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="h200")
    ap.add_argument("--models", default="llama-3-8b:bfloat16,llama-3-70b:float8,"
                    "llama-3.1-405b:float8")  # fmt: skip
    ap.add_argument("--devices", default="8,16")
    ap.add_argument("--input-lens", default="1024,2048,4096,8192")
    ap.add_argument("--output-lens", default="128,512,1024")
    ap.add_argument("--ttft-ms", type=float, default=2000.0)
    ap.add_argument("--tpot-ms", type=float, default=50.0)
    ap.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        help="share of requests meeting the TTFT target at the rate reported",
    )
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--kv-link", default="infiniband", choices=tuple(KV_LINKS))
    ap.add_argument("--tp-sizes", default="1,2,4,8", help="tensor parallel sizes to try "
                    "(8: one HGX node)")  # fmt: skip
    ap.add_argument("--json", default=None, help="also write every point here")
    args = ap.parse_args()
    args.tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    rows = []
    print(
        "| model | devices | in / out | best colocated req/s (layout: how) "
        "| best P:D req/s (layout: how) | P:D / colocated |"
    )
    print("|---|---:|---|---|---|---:|")
    for spec in args.models.split(","):
        model, args.weight_dtype = spec.split(":")
        for n in (int(x) for x in args.devices.split(",")):
            for p in (int(x) for x in args.input_lens.split(",")):
                for o in (int(x) for x in args.output_lens.split(",")):
                    load = Load(p, o, args.ttft_ms / 1e3, args.tpot_ms / 1e3, args.attainment)
                    row = point(model, n, load, args)
                    rows.append(row)
                    c, d = row["colocated"], row["pd"]
                    print(f"| {model} {args.weight_dtype} | {n} | {p} / {o} | {c[0]:.2f} "
                          f"({c[2]}: {c[1]}) | {d[0]:.2f} ({d[2]}: {d[1]}) "
                          f"| {row['ratio']:.2f} |", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
