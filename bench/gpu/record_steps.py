"""A served burst's step shapes, from the scheduler's step log, for the kernel-variant test.

Each step of the log names its requests in batch order with their token counts; a request's
length after the step is what it computed so far (no preemption and no prefix-cache hit in the
recorded burst: both are checked). The result is what the attention launch of each step sees:

    {"source": ..., "steps": [[num_tokens per sequence], [seq_len per sequence]], ...}

Recorded for tests/data/burst_steps.json from the real model on CPU (the plans' shapes do not
depend on the device; commands in tests/kernels/test_kernel_variants.py):

    python bench/gpu/record_steps.py LOG_DIR/scheduler.log --out tests/data/burst_steps.json \
        --source "..."
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from conveyor.bench.steplog import StepColumns  # noqa: E402


def step_shapes(log: Path) -> list[list[list[int]]]:
    """[[num_tokens...], [seq_len...]] per step, in step order; ValueError on a preemption or a
    prefix-cache hit (a length would not follow from the counts)."""
    columns, seen, steps = StepColumns(), {}, []
    for line in log.read_bytes().splitlines():
        if b'"step"' not in line:
            continue
        obj = columns.complete(orjson.loads(line))
        if obj is None or obj.get("event") != "step" or not obj.get("rids"):
            continue
        if obj.get("num_preemptions") or obj.get("num_prefix_cache_hits"):
            raise ValueError(f"step {obj.get('step_id')}: preemption or prefix hit; record again")
        lens = []
        for rid, n in zip(obj["rids"], obj["num_tokens"], strict=True):
            seen[rid] = seen.get(rid, 0) + int(n)
            lens.append(seen[rid])
        steps.append([[int(n) for n in obj["num_tokens"]], lens])
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="step shapes of a served burst, as JSON")
    p.add_argument("log", type=Path, help="the engine's scheduler.log")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--source", default="", help="how the burst was served (kept in the file)")
    args = p.parse_args(argv)
    steps = step_shapes(args.log)
    body = {"source": args.source, "num_steps": len(steps), "steps": steps}
    args.out.write_text(json.dumps(body, separators=(",", ":")) + "\n")
    print(f"{len(steps)} steps -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
