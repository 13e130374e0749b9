"""Where disaggregated prefill and decode wins, on the SIMULATED H200 (docs/simulator.md): the
same long-prompt workload through colocated engines (data parallel) and P:D layouts of the
same number of engines, over a load sweep, with goodput under TTFT and TPOT targets.

    PYTHONPATH=. .venv/bin/python bench/disagg_sim_map.py --layouts dp2,dp2:b512,1:1 \
        --rates 2,4,6 --model llama-3-8b --out bench_out/disagg_map

A layout: `dpN` (N colocated engines, optionally `:bTOKENS` for the step's token budget and
chunk size, a step composition, e.g. `dp2:b512:decode-first`, and `:tpN` for N simulated
devices per engine as one tensor-parallel group) or `P:D` (P prefill and D
decode engines; their budget is --budget; `P:D:two-sided` or `P:D:one-sided` sets when the
prefill workers answer KV reads, else --kv-reads: sim/kv_link.py; `P:D:tpA-B` gives each
prefill engine A simulated devices as one tensor-parallel group and each decode engine B, so
the layout takes P*A + D*B devices; a simulated group is one process, its KV moved as one,
its wire time per rank: sim/kv_link.py). Every layout is one stack
of simulated workers (`--worker sim`, the KV hand-over over --kv-link, modelled); per rate,
`conveyor bench --goodput ttft:MS tpot:MS` runs --seconds of Poisson arrivals against it.
Prints a table (goodput req/s, the share of requests meeting both targets, TTFT and TPOT p99)
and writes <out>/map.json. The figures are the cost model's, not a GPU's. Run it alone
(`flock -x`): the engines' own software runs for real on this host and shares its cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from conveyor.bench.cli import main as bench_main
from conveyor.launcher import LocalStack, StackSettings
from services.scheduler.config import SchedulerConfig
from services.worker.sim.config import SimConfig
from services.worker.sim.kv_link import KV_READS


@dataclass(frozen=True, slots=True)
class Layout:
    name: str
    num_colocated: int  # 0: disaggregated
    prefill: int = 0
    decode: int = 0
    budget: Optional[int] = None  # None: --budget
    composition: str = "mixed"
    kv_reads: Optional[str] = None  # None: --kv-reads
    prefill_tp: int = 1  # simulated devices per prefill (or colocated) engine: one TP group
    decode_tp: int = 1

    @property
    def num_devices(self) -> int:
        if self.num_colocated:
            return self.num_colocated * self.prefill_tp
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp


def parse_layout(text: str) -> Layout:
    head, *opts = text.split(":")
    if not head.startswith("dp"):
        p, d = int(head), int(opts[0])
        kv_reads, sizes = None, (1, 1)
        for opt in opts[1:]:
            if opt.startswith("tp"):
                a, b = opt[2:].split("-")
                sizes = (int(a), int(b))
            else:
                kv_reads = opt
        return Layout(text, 0, p, d, kv_reads=kv_reads, prefill_tp=sizes[0], decode_tp=sizes[1])
    budget, composition, size = None, "mixed", 1
    for opt in opts:
        if opt.startswith("b"):
            budget = int(opt[1:])
        elif opt.startswith("tp"):
            size = int(opt[2:])
        else:
            composition = opt
    return Layout(text, int(head[2:]), budget=budget, composition=composition, prefill_tp=size,
                  decode_tp=size)  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="dp2,dp2:b512,1:1")
    p.add_argument("--rates", default="2,4,6", help="req/s (Poisson)")
    p.add_argument("--seconds", type=float, default=20.0, help="arrivals per run: rate x this")
    p.add_argument("--min-prompts", type=int, default=30)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--weight-dtype", default="bfloat16")
    p.add_argument("--device", default="h200")
    p.add_argument("--kv-link", default="infiniband")
    p.add_argument(
        "--kv-reads",
        default="auto",
        choices=KV_READS,
        help="when prefill workers answer KV reads (sim/kv_link.py; auto: the link's way)",
    )
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--max-model-len", type=int, default=None, help="the simulated workers' (default: model's)"
    )
    p.add_argument("--budget", type=int, default=2048, help="token budget and chunk size")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--ttft-ms", type=float, default=2000.0)
    p.add_argument("--tpot-ms", type=float, default=50.0)
    p.add_argument("--out", type=Path, default=Path("bench_out/disagg_map"))
    return p.parse_args(argv)


def stack_settings(args: argparse.Namespace, layout: Layout, log_dir: Path) -> StackSettings:
    budget = layout.budget or args.budget
    # a budget under --max-num-seqs caps the slots too (the scheduler needs budget >= slots)
    sched = SchedulerConfig(
        max_num_seqs=min(args.max_num_seqs, budget), max_num_batched_tokens=budget,
        chunk_size=budget,
        step_composition=layout.composition,  # type: ignore[arg-type]
    )  # fmt: skip
    sim = SimConfig(device=args.device, model=args.model, weight_dtype=args.weight_dtype,
                    kv_link=args.kv_link, kv_reads=layout.kv_reads or args.kv_reads,
                    max_model_len=args.max_model_len)  # fmt: skip
    engines: dict[str, int] = (
        {"data_parallel_size": layout.num_colocated}
        if layout.num_colocated
        else {"prefill_engines": layout.prefill, "decode_engines": layout.decode}
    )
    return StackSettings(
        worker="sim", sim_config=sim, scheduler_config=sched, gateway=False, log_dir=log_dir,
        frontend_address=f"tcp://127.0.0.1:{_free_port()}", **engines,
    )  # fmt: skip


class MixedTpStack(LocalStack):
    """A local stack whose prefill engines are `layout.prefill_tp` simulated devices each (one
    tensor-parallel group, modelled in one worker process) and its decode engines
    `layout.decode_tp` (`conveyor up` gives every engine one size)."""

    def __init__(self, settings: StackSettings, layout: Layout) -> None:
        super().__init__(settings)
        self._layout = layout

    def _start_engine(self, index: int) -> str:
        shared, layout = self.settings, self._layout
        size = layout.prefill_tp if index < layout.prefill else layout.decode_tp
        self.settings = dataclasses.replace(shared, tensor_parallel_size=size)
        try:
            return super()._start_engine(index)
        finally:
            self.settings = shared


def run_rate(
    args: argparse.Namespace, address: str, rate: float, seed: int, out: Path
) -> dict[str, Any]:
    """One `conveyor bench` run at `rate`; its result.json. Each rate has prompts of its own
    (`seed`): the engines' prefix caches keep the earlier rates' prompts."""
    num = max(args.min_prompts, round(rate * args.seconds))
    argv = [
        "--address", address, "--workload", "random", "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--num-prompts", str(num), "--ignore-eos",
        "--request-rate", str(rate), "--num-warmups", "1", "--no-plots", "--no-progress",
        "--goodput", f"ttft:{args.ttft_ms:g}", f"tpot:{args.tpot_ms:g}", "--out", str(out),
        "--seed", str(seed),
    ]  # fmt: skip
    bench_main(argv)
    return json.loads((out / "result.json").read_text())


def row(layout: Layout, rate: float, r: dict[str, Any]) -> dict[str, Any]:
    done = r["completed"] + r["failed"]
    met = r["request_goodput"] * r["duration"]
    return {
        "layout": layout.name,
        "devices": layout.num_devices,
        "rate": rate,
        "goodput": round(r["request_goodput"], 2),
        "met": round(met / done, 3) if done else 0.0,
        "ttft_p99_s": round(r["p99_ttft_ms"] / 1000, 2),
        "tpot_p50_ms": round(r["median_tpot_ms"], 1),
        "tpot_p99_ms": round(r["p99_tpot_ms"], 1),
        "tok_s": round(r["output_throughput"]),
        "failed": r["failed"],
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    layouts = [parse_layout(x) for x in args.layouts.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    rows = []
    for layout in layouts:
        log_dir = args.out / "logs" / layout.name.replace(":", "-")
        with MixedTpStack(stack_settings(args, layout, log_dir), layout) as stack:
            for i, rate in enumerate(rates):
                out = args.out / layout.name.replace(":", "-") / f"rate-{rate:g}"
                result = run_rate(args, stack.frontend_address, rate, i + 1, out)
                rows.append(row(layout, rate, result))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print_table(rows)
    report = {
        "argv": argv,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "simulated": f"{args.device} {args.model} {args.weight_dtype}, {args.kv_link}"
        + f", KV reads {args.kv_reads} (unless the layout says)",
        "rows": rows,
    }
    (args.out / "map.json").write_text(json.dumps(report, indent=1))
    return 0


def print_table(rows: list[dict[str, Any]]) -> None:
    heads = list(rows[0])
    print(" | ".join(heads))
    for r in rows:
        print(" | ".join(str(r[h]) for h in heads))
    best: dict[float, dict[str, float]] = {}
    for r in rows:
        best.setdefault(r["rate"], {})[r["layout"]] = r["goodput"]
    for rate, by in best.items():
        co = max((g for name, g in by.items() if name.startswith("dp")), default=0.0)
        pd = max((g for name, g in by.items() if not name.startswith("dp")), default=0.0)
        ratio = f"{pd / co:.2f}x" if co else "inf"
        print(f"rate {rate:g}: best colocated {co:g}, best P:D {pd:g} req/s -> {ratio}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
