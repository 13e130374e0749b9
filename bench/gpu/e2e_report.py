"""The end-to-end run's summary and Markdown table (standard library only).

`summarize` reads the stages' JSON (report["results"]) and states the issue's three goals with
the figures they rest on; `markdown` lays the whole run out in a few short tables. A goal whose
figure is missing (its stage failed or was cut) says so rather than guessing.
"""

from __future__ import annotations

from typing import Any, Optional

DECODE_GOAL_PCT = 80.0  # decode attention >= 80% of the measured copy bandwidth
OVERHEAD_GOAL = 0.10  # step share outside the forward pass <= 10% at 256 running
OVERHEAD_AT = 256
PIPELINE_OFF = "-pipeline-off"  # serving stages run again with the worker's pipelining off
SPEEDUP_GOAL = 3.0  # continuous batching >= 3x transformers' static generate()


def serving_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (model, burst): the engine's figures beside transformers'."""
    rows = []
    for name, serve in results.items():
        if not name.startswith("serve_"):
            continue
        kind = name.removeprefix("serve_")
        reference = results.get("hf_static", {}).get("models", {}).get(kind, {})
        hf = {b["burst"]: b for b in reference.get("bursts", [])}
        for burst in serve.get("bursts", []):
            steps = burst.get("steps") or {}
            full = steps.get("full_batch") or {}
            ref = hf.get(burst["burst"], {})
            engine_tps, hf_tps = burst.get("output_throughput"), ref.get("output_throughput")
            rows.append(
                {
                    "model": kind,
                    "burst": burst["burst"],
                    "ok": burst.get("ok"),
                    "output_tok_s": engine_tps,
                    "ttft_p50_ms": burst.get("median_ttft_ms"),
                    "ttft_p99_ms": burst.get("p99_ttft_ms"),
                    "tpot_p50_ms": burst.get("median_tpot_ms"),
                    "tpot_p99_ms": burst.get("p99_tpot_ms"),
                    "step_ms": (steps.get("all") or {}).get("mean_step_ms"),
                    "full_batch_step_ms": full.get("mean_period_ms"),
                    "outside_forward_share": full.get("outside_forward_share"),
                    "device_idle_us": (burst.get("device_time") or {}).get("mean_idle_us"),
                    "hf_static_tok_s": hf_tps,
                    "speedup": engine_tps / hf_tps if engine_tps and hf_tps else None,
                }
            )
    return rows


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    results = report.get("results", {})
    check = results.get("gpu_check", {})
    rows = serving_rows(results)
    # the goals judge the default engine; the pipelining-off rows are a comparison only
    judged = [r for r in rows if not r["model"].endswith(PIPELINE_OFF)]
    decode = check.get("decode_attention") or []
    best = max(decode, key=lambda r: r["pct_copy"], default=None)
    largest = max(decode, key=lambda r: (r["batch"] * r["context"], r["head_dim"]), default=None)
    at_256 = [
        r for r in judged if r["burst"] == OVERHEAD_AT and r["outside_forward_share"] is not None
    ]
    speedups = [r for r in judged if r["speedup"] is not None]
    return {
        "kernel_checks": {
            "passed": sum(1 for c in check.get("checks", []) if c.get("ok")),
            "total": len(check.get("checks", [])),
            "stopped_early": check.get("stopped_early"),
        },
        "copy_gb_s": (check.get("copy") or {}).get("gb_s"),
        "goals": {
            # judged at the largest decode measured (batch x context): small decodes cannot
            # fill the memory system, and the best row alone would flatter
            "decode_attention_vs_copy": _goal(
                largest and largest["pct_copy"],
                DECODE_GOAL_PCT,
                at_least=True,
                detail={"largest": largest, "best": best},
            ),
            "overhead_at_256": _goal(
                max((r["outside_forward_share"] for r in at_256), default=None),
                OVERHEAD_GOAL,
                at_least=False,
                detail={r["model"]: r["outside_forward_share"] for r in at_256},
            ),
            "continuous_vs_static": _goal(
                min((r["speedup"] for r in speedups), default=None),
                SPEEDUP_GOAL,
                at_least=True,
                detail={f"{r['model']}@{r['burst']}": r["speedup"] for r in speedups},
            ),
        },
        "serving": rows,
    }


def _goal(value: Optional[float], bound: float, at_least: bool, detail: Any) -> dict[str, Any]:
    """`value` is the worst case the goal is judged on (None: not measured)."""
    met = None if value is None else (value >= bound if at_least else value <= bound)
    return {"value": value, "bound": bound, "at_least": at_least, "met": met, "detail": detail}


def _f(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def markdown(report: dict[str, Any]) -> str:
    s, host = report["summary"], report.get("host", {})
    lines = [
        f"# Conveyor end to end ({report['mode']}): {host.get('gpu') or 'no GPU'}, "
        f"{report['started']}, commit {host.get('commit') or '?'}",
        "",
        "| stage | ok | seconds | limit s | note |",
        "|---|---|---:|---:|---|",
    ]
    for st in report["stages"]:
        note = st.get("note") or ("timed out" if st.get("timed_out") else "")
        lines.append(
            f"| {st['name']} | {'yes' if st['ok'] else '**NO**'} | "
            f"{_f(st.get('seconds'))} | {_f(st.get('limit_s'))} | {note} |"
        )
    kc = s["kernel_checks"]
    lines += [
        "",
        f"Kernel checks: {kc['passed']}/{kc['total']} passed"
        + (f" (stopped early: {kc['stopped_early']})" if kc["stopped_early"] else "")
        + f"; device copy {_f(s['copy_gb_s'], 0)} GB/s.",
        "",
    ]
    lines += _correctness_lines(report["results"].get("correctness", {}))
    lines += [
        "",
        "| model | burst | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
        "step ms | full-batch period ms | outside forward | device idle / step µs | "
        "transformers static tok/s | x static |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["serving"]:
        share = r["outside_forward_share"]
        lines.append(
            f"| {r['model']} | {r['burst']} | {_f(r['output_tok_s'], 0)} | "
            f"{_f(r['ttft_p50_ms'])} / {_f(r['ttft_p99_ms'])} | "
            f"{_f(r['tpot_p50_ms'], 2)} / {_f(r['tpot_p99_ms'], 2)} | {_f(r['step_ms'], 2)} | "
            f"{_f(r['full_batch_step_ms'], 2)} | {'-' if share is None else f'{share:.1%}'} | "
            f"{_f(r['device_idle_us'], 0)} | {_f(r['hf_static_tok_s'], 0)} | "
            f"{_f(r['speedup'], 2)} |"
        )
    lines += ["", "| goal | worst case | bound | met |", "|---|---:|---:|---|"]
    for name, g in s["goals"].items():
        met = "not measured" if g["met"] is None else ("yes" if g["met"] else "**no**")
        lines.append(
            f"| {name} | {_f(g['value'], 3)} | {'>=' if g['at_least'] else '<='} "
            f"{g['bound']} | {met} |"
        )
    return "\n".join(lines) + "\n"


def _correctness_lines(c: dict[str, Any]) -> list[str]:
    checks = c.get("checks") or {}
    if not checks:
        return ["Correctness: no result."]
    out = ["| correctness check | ok | figures |", "|---|---|---|"]
    for name, r in checks.items():
        figures = {k: v for k, v in r.items() if k not in ("ok", "prompts", "seconds")}
        out.append(f"| {name} | {'yes' if r.get('ok') else '**NO**'} | {_short(figures)} |")
    return out


def _short(d: dict[str, Any]) -> str:
    parts = []
    for k, v in d.items():
        if isinstance(v, dict):
            v = "{" + _short(v) + "}"
        elif isinstance(v, float):
            v = f"{v:.3g}"
        parts.append(f"{k}={v}")
    return ", ".join(parts)
