"""What a comparison runs (`conveyor bench --compare`, `--compare-batching`): its flags, the
compared setting and values, and the scenarios (the workload of a plain run's flags, or named
burst workloads). compare.py starts the engines and runs it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from conveyor.bench.arrivals import ArrivalConfig
from conveyor.bench.backends import SamplingChoice
from conveyor.bench.texts import TEXT_WORKLOADS, tokenizer_folder
from conveyor.bench.workloads import WorkloadConfig

MODES = ("static", "dynamic", "continuous")
SCENARIOS = ("uniform", "mixed", "high-concurrency", "chat", *TEXT_WORKLOADS)
DEFAULT_SCENARIOS = SCENARIOS[:3]  # `chat` (heavy-tailed) only on request
# --compare-batching's defaults, sized to finish in ~10 minutes on 2 CPU cores with SmolLM2
# (see docs/bench.md); the named scenarios use the first two under any --compare
DEFAULT_NUM_PROMPTS = 32
DEFAULT_SCALE = 0.5
DEFAULT_BATCH_SIZE = 16


def add_compare_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("comparisons (start their own engines)")
    g.add_argument(
        "--compare",
        default=None,
        metavar="FIELD=A,B,...",
        help="one engine per value of one `conveyor up` setting, e.g. "
        "step_composition=mixed,prefill-first,decode-first",
    )
    g.add_argument(
        "--compare-batching",
        action="store_true",
        help="= --compare batching=static,dynamic,continuous (--modes) over the "
        "batching scenarios, with slot utilization and the analytical model",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="B: max_num_seqs (and static/dynamic batch size) of every engine; "
        f"default the engine's own (--compare-batching: {DEFAULT_BATCH_SIZE})",
    )
    # Long enough that a burst is all queued before static/dynamic form their first batch (the
    # frontend forwards requests one by one); only a last, partial batch ever waits for it.
    g.add_argument("--batch-timeout", type=float, default=0.5)
    g.add_argument(
        "--scenarios",
        default=None,
        help=f"burst scenarios from {', '.join(SCENARIOS)} instead of the workload "
        f"flags (--compare-batching: {','.join(DEFAULT_SCENARIOS)})",
    )
    g.add_argument("--modes", default=",".join(MODES), help="--compare-batching's values")
    g.add_argument("--high-concurrency-factor", type=int, default=4)
    g.add_argument("--worker", choices=("model", "sim"), default="model")
    g.add_argument("--sim-device", default=None, help="with --worker sim, e.g. h200")
    g.add_argument("--sim-model", default=None, help="with --worker sim, e.g. llama-3-8b")
    g.add_argument(
        "--engine-flag",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra scheduler flag, e.g. max_num_batched_tokens=512",
    )
    g.add_argument("--worker-flag", action="append", default=[], metavar="NAME=VALUE")
    g.add_argument("--engine-timeout", type=float, default=600.0, help="s to wait for ready")


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    workload: WorkloadConfig
    arrivals: ArrivalConfig
    sampling: SamplingChoice


@dataclass(frozen=True, slots=True)
class Comparison:
    """What `--compare` (or `--compare-batching`) asked for."""

    field: str  # a `conveyor up` setting, snake_case
    values: list[str]
    scenarios: list[Scenario]
    batch_size: Optional[int]  # max_num_seqs = batch_size of every engine; None: its own


def comparison_from_args(args: argparse.Namespace, flags_scenario: Scenario) -> Comparison:
    """The comparison the flags ask for (ValueError when they do not make one);
    `flags_scenario`: the workload of a plain run's flags, run when no scenario is named."""
    if args.compare_batching == (args.compare is not None):
        raise ValueError("give one of --compare FIELD=A,B,... and --compare-batching")
    if args.compare_batching:
        field, values = "batching", _list(args.modes, MODES, "--modes")
        batch_size = DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size
        names = args.scenarios or ",".join(DEFAULT_SCENARIOS)
    else:
        name, sep, raw = args.compare.partition("=")
        values = [v.strip() for v in raw.split(",") if v.strip()]
        if not sep or not name.strip() or not values:
            raise ValueError(f"--compare {args.compare!r}: use FIELD=A,B,...")
        field, batch_size, names = name.strip().replace("-", "_"), args.batch_size, args.scenarios
    if len(set(values)) != len(values):
        raise ValueError(f"--compare: a value twice in {values}")
    plan = burst_scenarios(args, names) if names else [flags_scenario]
    return Comparison(field, values, plan, batch_size)


def burst_scenarios(args: argparse.Namespace, names: str) -> list[Scenario]:
    """The named burst workloads (EOS ignored, greedy), sized by --num-prompts and --scale
    (defaults 32 and 0.5 here); the natural-text ones (copy, edit, quote: texts.py) end at the
    model's own end of turn, `--max-concurrency` streams at a time."""
    selected = _list(names, SCENARIOS, "--scenarios")
    texts = [_text_scenario(args, s) for s in selected if s in TEXT_WORKLOADS]
    bursts = _bursts(args, [s for s in selected if s not in TEXT_WORKLOADS])
    return [next(sc for sc in (*texts, *bursts) if sc.name == s) for s in selected]


def _text_scenario(args: argparse.Namespace, name: str) -> Scenario:
    n = DEFAULT_NUM_PROMPTS if args.num_prompts is None else args.num_prompts
    tokenizer = tokenizer_folder(args.tokenizer or args.model)
    workload = WorkloadConfig(name=name, num_prompts=n, seed=args.seed, tokenizer=tokenizer)
    arrivals = ArrivalConfig(seed=args.seed, max_concurrency=args.max_concurrency)
    return Scenario(name, workload, arrivals, SamplingChoice(temperature=0.0))


def _bursts(args: argparse.Namespace, names: list[str]) -> list[Scenario]:
    n = DEFAULT_NUM_PROMPTS if args.num_prompts is None else args.num_prompts
    scale = DEFAULT_SCALE if args.scale is None else args.scale
    common = {"seed": args.seed, "scale": scale}
    table = {
        "uniform": WorkloadConfig(
            name="uniform", num_prompts=n, input_len=256, output_len=128, **common
        ),
        "mixed": WorkloadConfig(name="mixed", num_prompts=n, **common),
        "chat": WorkloadConfig(name="chat", num_prompts=n, **common),
        "high-concurrency": WorkloadConfig(
            name="mixed", num_prompts=n * args.high_concurrency_factor, **common
        ),
    }
    burst = ArrivalConfig(seed=args.seed)
    greedy = SamplingChoice(temperature=0.0, ignore_eos=True)
    return [Scenario(s, table[s], burst, greedy) for s in names]


def _list(raw: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [x.strip() for x in raw.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"{flag}: choose from {', '.join(allowed)} (got {raw!r})")
    return items


def pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{flag} {item!r}: use NAME=VALUE")
        out[name.strip().replace("-", "_")] = value
    return out
