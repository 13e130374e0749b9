"""The P:D map (bench/disagg_sim_map.py) read again under other latency targets, and against a
decode-only baseline (SIMULATED H200: cost-model figures, not a GPU's).

    PYTHONPATH=. .venv/bin/python bench/disagg_map_targets.py bench_out/disagg_map \
        --ttft-ms 2000,1000 --tpot-ms 50,25 --model llama-3-70b --weight-dtype float8

Per (TTFT, TPOT) target and rate: the best colocated and the best P:D goodput (req/s meeting
both targets, recomputed from each run's per-request TTFT and latency in result.json, as
`conveyor bench --goodput` counts them) and their ratio. Then, per P:D run, its TPOT p99
against a decode-only baseline: the cost model's step for a batch of pure decodes at the run's
mean decode batch per decode engine (Little's law: completed/s x mean decode time / D) and the
mean context (prompt + half the output), the time a decode engine with nothing else to do
would take per token. Reads files only: no engine runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from services.worker.sim.config import SimConfig
from services.worker.sim.cost_model import step_cost, step_work


def runs(out: Path) -> list[tuple[str, float, dict[str, Any]]]:
    """(layout, rate, result) of every run under a map's --out."""
    found = []
    for path in sorted(out.glob("*/rate-*/result.json")):
        layout = path.parent.parent.name
        rate = float(path.parent.name.removeprefix("rate-"))
        found.append((layout, rate, json.loads(path.read_text())))
    return found


def goodput(r: dict[str, Any], ttft_ms: float, tpot_ms: float) -> float:
    met = 0
    for ttft, e2el, n, err in zip(r["ttfts"], r["e2els"], r["output_lens"], r["errors"],
                                  strict=True):  # fmt: skip
        if err or ttft is None or e2el is None:
            continue
        tpot = (e2el - ttft) / (n - 1) if n > 1 else 0.0
        met += ttft * 1000 <= ttft_ms and tpot * 1000 <= tpot_ms
    return met / r["duration"]


def decode_only_tpot_ms(r: dict[str, Any], num_decode: int, config: SimConfig) -> float:
    """The cost model's pure-decode step at the run's mean decode batch per decode engine."""
    ok = [i for i, err in enumerate(r["errors"]) if not err]
    decode_s = np.mean([r["e2els"][i] - r["ttfts"][i] for i in ok])
    batch = max(1, round(len(ok) / r["duration"] * decode_s / num_decode))
    context = int(np.mean(r["input_lens"]) + np.mean(r["output_lens"]) / 2)
    work = step_work(config.model_shape(), [context] * batch, [1] * batch, batch)
    return step_cost(config.device_profile(), work).total_s * 1000


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outs", nargs="+", type=Path, help="--out folders of disagg_sim_map.py")
    p.add_argument("--ttft-ms", default="2000")
    p.add_argument("--tpot-ms", default="50")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--weight-dtype", default="bfloat16")
    p.add_argument("--device", default="h200")
    args = p.parse_args(argv)
    found = [run for out in args.outs for run in runs(out)]
    rates = sorted({rate for _, rate, _ in found})
    for ttft_ms in (float(x) for x in args.ttft_ms.split(",")):
        for tpot_ms in (float(x) for x in args.tpot_ms.split(",")):
            for rate in rates:
                at = [(name, goodput(r, ttft_ms, tpot_ms)) for name, x, r in found if x == rate]
                co = max(((g, n) for n, g in at if n.startswith("dp")), default=(0.0, "-"))
                pd = max(((g, n) for n, g in at if not n.startswith("dp")), default=(0.0, "-"))
                ratio = f"{pd[0] / co[0]:.2f}x" if co[0] else "-"
                print(f"ttft {ttft_ms:g} tpot {tpot_ms:g} rate {rate:g}: colocated {co[1]} "
                      f"{co[0]:.2f}, P:D {pd[1]} {pd[0]:.2f} -> {ratio}")  # fmt: skip
    config = SimConfig(device=args.device, model=args.model, weight_dtype=args.weight_dtype)
    for name, rate, r in found:
        if name.startswith("dp"):
            continue
        parts = name.split("-")  # P-D, then options: tpA-B (each decode engine B devices)
        num_decode = int(parts[1])
        decode_tp = int(parts[-1]) if any(x.startswith("tp") for x in parts) else 1
        decode = dataclasses.replace(config, tensor_parallel_size=decode_tp)
        base = decode_only_tpot_ms(r, num_decode, decode)
        p99 = r["p99_tpot_ms"]
        print(f"{name} rate {rate:g}: TPOT p99 {p99:.1f} ms, decode-only {base:.1f} ms "
              f"-> {p99 / base:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
