"""The side-by-side table of `bench/peer_llama_server.sh run`: every engine on one burst.

Reads what the script left in `--dir`: each OpenAI engine's `<engine>/result.json`
(llama-server, conveyor; `conveyor bench --backend openai`), `hf-static.json`
(bench/hf_static_burst.py) and `roofline.txt` (bench/roofline.py's printout; its floor line is
parsed, since roofline.py writes no JSON). Prints a markdown table (output tok/s, TTFT p50,
fraction of the linear-layer floor, Conveyor's throughput and TTFT against each engine) and
writes `peers.json` beside the inputs.

    PYTHONPATH=. python bench/peer_table.py --dir results/peers-20261201-080000
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Optional

# bench/roofline.py: "... roofline (faster dtype, float32): 107 output tok/s"
_FLOOR_LINE = re.compile(r"roofline \(faster dtype, (\w+)\): (\d+(?:\.\d+)?) output tok/s")


def read_engines(folder: Path) -> dict[str, dict[str, Any]]:
    """One entry per engine present: output tok/s, TTFT p50 (s), tokens, and what it was."""
    engines: dict[str, dict[str, Any]] = {}
    for name in ("conveyor", "conveyor-fp32", "llama-server"):
        path = folder / name / "result.json"
        if not path.is_file():
            continue
        run = json.loads(path.read_text())
        cmd = folder / f"{name}.cmd"
        engines[name] = {
            "output_tok_s": float(run["output_throughput"]),
            "ttft_p50_s": float(run["median_ttft_ms"]) / 1e3,
            "ttft_is_lower_bound": False,
            "decode_tok_s": 1e3 / float(run["median_tpot_ms"]) if run["median_tpot_ms"] else None,
            "output_tokens": int(run["total_output_tokens"]),
            "prompt_tokens": int(run["total_input_tokens"]),
            "completed": int(run["completed"]),
            "failed": int(run["failed"]),
            "duration_s": float(run["duration"]),
            "server_command": cmd.read_text().strip() if cmd.is_file() else None,
        }
    hf = folder / "hf-static.json"
    if hf.is_file():
        run = json.loads(hf.read_text())
        engines["transformers static"] = {
            "output_tok_s": float(run["output_throughput"]),
            "ttft_p50_s": float(run["ttft_p50_lower_bound_s"]),
            "ttft_is_lower_bound": True,
            "decode_tok_s": None,
            "output_tokens": int(run["output_tokens"]),
            "prompt_tokens": int(run["prompt_tokens"]),
            "completed": int(run["num_requests"]),
            "failed": 0,
            "duration_s": float(run["seconds"]),
            "server_command": None,
        }
    return engines


def read_floor(folder: Path) -> Optional[dict[str, Any]]:
    """The roofline's floor (output tok/s at the faster dtype) and its rate lines, if it ran."""
    path = folder / "roofline.txt"
    if not path.is_file():
        return None
    text = path.read_text()
    match = _FLOOR_LINE.search(text)
    if match is None:
        raise ValueError(f"{path}: no 'roofline (faster dtype, ...)' line from bench/roofline.py")
    rates = [line for line in text.splitlines() if line.startswith(("float32:", "bfloat16:"))]
    return {"dtype": match.group(1), "output_tok_s": float(match.group(2)), "rates": rates}


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return None if num is None or not den else num / den


def build_rows(
    engines: dict[str, dict[str, Any]], floor: Optional[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per engine, then the floor; Conveyor's ratios against every other engine."""
    ours = engines.get("conveyor")
    ours_tok_s = ours and ours["output_tok_s"]
    rows = []
    for name, e in engines.items():
        rows.append(
            {
                "engine": name,
                "output_tok_s": e["output_tok_s"],
                "ttft_p50_s": e["ttft_p50_s"],
                "ttft_is_lower_bound": e["ttft_is_lower_bound"],
                "decode_tok_s": e["decode_tok_s"],
                "of_floor": _ratio(e["output_tok_s"], floor and floor["output_tok_s"]),
                # > 1: Conveyor is that many times faster (tok/s) / that many times quicker (TTFT)
                "conveyor_tok_s_ratio": _ratio(ours_tok_s, e["output_tok_s"]),
                "conveyor_ttft_ratio": _ratio(e["ttft_p50_s"], ours and ours["ttft_p50_s"]),
            }
        )
    if floor is not None:
        rows.append(
            {
                "engine": f"linear-layer floor ({floor['dtype']})",
                "output_tok_s": floor["output_tok_s"],
                "ttft_p50_s": None,
                "ttft_is_lower_bound": False,
                "decode_tok_s": None,
                "of_floor": 1.0,
                "conveyor_tok_s_ratio": _ratio(ours_tok_s, floor["output_tok_s"]),
                "conveyor_ttft_ratio": None,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    def num(v: Optional[float], fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        "| engine | output tok/s | decode tok/s (1 / TPOT p50) | TTFT p50 (s) | of the floor "
        "| Conveyor ÷ it (tok/s) | its TTFT ÷ Conveyor's |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ttft = num(r["ttft_p50_s"], ".1f")
        if r["ttft_is_lower_bound"]:
            ttft = f"≥ {ttft}"
        lines.append(
            f"| {r['engine']} | {num(r['output_tok_s'], '.1f')} | {num(r['decode_tok_s'], '.1f')} "
            f"| {ttft} "
            f"| {num(r['of_floor'], '.0%')} | {num(r['conveyor_tok_s_ratio'], '.2f')} "
            f"| {num(r['conveyor_ttft_ratio'], '.2f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="the script's output folder")
    args = ap.parse_args()
    engines = read_engines(args.dir)
    floor = read_floor(args.dir)
    rows = build_rows(engines, floor)
    machine = args.dir / "machine.txt"
    report = {
        "machine": machine.read_text() if machine.is_file() else None,
        "engines": engines,
        "floor": floor,
        "rows": rows,
    }
    (args.dir / "peers.json").write_text(json.dumps(report, indent=2))
    if report["machine"]:
        print(report["machine"].rstrip())
    if floor is not None:
        print("\n".join(floor["rates"]))
    for name, e in engines.items():
        print(
            f"{name}: {e['completed']} done, {e['failed']} failed, {e['prompt_tokens']} prompt + "
            f"{e['output_tokens']} output tokens in {e['duration_s']:.1f} s"
        )
    print(markdown(rows))
    print(f"results: {args.dir / 'peers.json'}")


if __name__ == "__main__":
    main()
