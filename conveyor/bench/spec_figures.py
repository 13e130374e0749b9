"""Speculation in `conveyor bench --compare`: the engine's draft counters over a scenario, and
the speedup predicted from what the run measured, so the overhead outside the forward shows.

Prediction (issue 30's "≥ 85% of the speedup predicted from the measured acceptance and step
times"): a decode row of the run with drafts emits `tokens_per_row` tokens a step (output tokens
after each request's first, over the decode rows of the run's steps), a row without drafts ~1;
a step takes `mean_decode_step_ms` (plan sent → result, decode-only steps). If nothing but the
steps took time, the speedup would be

    predicted = (tokens_per_row_on / tokens_per_row_off) × (step_ms_off / step_ms_on)

and the measured output tok/s ratio falls short of it by what the engine spends between steps
(the scheduler's work on drafts, more tokens to detokenize and stream) and by steps that are
not decode-only (prefill, mixed). `of predicted` = measured ÷ predicted.
"""

from __future__ import annotations

from typing import Any, Optional

from shared.client import Client


def spec_counters(address: str) -> dict[str, float]:
    """The engine's speculation counters since start (spec_decode_*; none: it does not
    speculate)."""
    with Client(address, timeout=30.0) as client:
        engine = client.stats().get("engine") or {}
    return {k: v for k, v in engine.items() if k.startswith("spec_decode_")}


def drafts(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """A scenario's speculation (counters after - before, warm-up included): draft tokens,
    accepted ones, the share accepted, and per draft position the share of drafting rows
    whose draft there was accepted (vLLM's acceptance per position)."""
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    drafted = delta.get("spec_decode_num_draft_tokens", 0)
    rows = delta.get("spec_decode_num_drafts", 0)
    if not drafted or not rows:
        return {}
    accepted = delta.get("spec_decode_num_accepted_tokens", 0)
    per_pos, j = [], 0
    while f"spec_decode_num_accepted_tokens_pos_{j}" in delta:
        per_pos.append(delta[f"spec_decode_num_accepted_tokens_pos_{j}"] / rows)
        j += 1
    return {
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_accepted_share": accepted / drafted,
        "spec_accepted_per_pos": per_pos,
    }


def tokens_per_decode_row(r: dict[str, Any]) -> Optional[float]:
    """Output tokens a decode row of the run emitted a step (each request's first token comes
    from its prefill); None without decode rows in the step log."""
    rows = r.get("num_decode_rows")
    if not rows:
        return None
    return (r["total_output_tokens"] - r["completed"]) / rows


def predicted_columns(r: dict[str, Any], base: Optional[dict[str, Any]]) -> dict[str, Any]:
    """`pred x` (the speedup the steps alone would give) and `of pred %` (measured ÷ that) of
    run `r` against the run without drafts `base`; None where a figure is missing."""
    none: dict[str, Any] = {"pred x": None, "of pred %": None}
    if base is None or base is r or not base.get("output_throughput"):
        return none
    tpr, tpr_base = tokens_per_decode_row(r), tokens_per_decode_row(base)
    step, step_base = r.get("mean_decode_step_ms"), base.get("mean_decode_step_ms")
    if not (tpr and tpr_base and step and step_base):
        return none
    predicted = (tpr / tpr_base) * (step_base / step)
    measured = r["output_throughput"] / base["output_throughput"]
    return {"pred x": predicted, "of pred %": 100.0 * measured / predicted}
