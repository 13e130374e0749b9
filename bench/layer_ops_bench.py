"""Time the C++ layer ops (rms_norm with residual, rotary, silu_and_mul) against torch's ops.

One call each at SmolLM2's shapes (hidden 576, 9/3 heads of 64, intermediate 1536) and `--rows`
rows (32: a B=32 decode step; 256: a burst's mixed step), fp32, current threads, best of
`--repeat`; the torch column is the worker's TorchOps (the reference path). With `--baseline REV`
the extension as it was at git revision REV is built too (once, cached beside the worker's
builds) and timed in the same process, so a kernel change is measured before/after side by side.

    PYTHONPATH=. python bench/layer_ops_bench.py [--rows 32,256] [--repeat 200]
        [--baseline main]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from bench.cpu_attention_bench import best_ms
from kernels.cpu_ext import CFLAGS, load_cpu_ops
from services.worker.ops import TorchOps
from services.worker.ops_cpu import ext_cache_dir

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536


def load_at_revision(rev: str) -> ModuleType:
    """The extension built from kernels/csrc as it is at `rev` (cached by commit)."""
    from torch.utils.cpp_extension import load

    commit = subprocess.check_output(["git", "rev-parse", rev], text=True).strip()
    files = subprocess.check_output(
        ["git", "ls-tree", "--name-only", commit, "kernels/csrc/"], text=True
    ).split()
    src = Path(tempfile.mkdtemp(prefix="conveyor-csrc-"))
    for name in files:
        blob = subprocess.check_output(["git", "show", f"{commit}:{name}"])
        (src / Path(name).name).write_bytes(blob)
    folder = ext_cache_dir() / f"rev-{commit[:12]}"
    folder.mkdir(parents=True, exist_ok=True)
    return load(
        name=f"conveyor_cpu_ops_rev_{commit[:12]}",
        sources=[str(p) for p in sorted(src.glob("*.cpp"))],
        extra_cflags=list(CFLAGS),
        build_directory=str(folder),
    )


def cases(ops: object, rows: int) -> dict[str, Callable[[], object]]:
    """One call of each op on fresh random inputs of `rows` rows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, HIDDEN, generator=gen)
    res = torch.randn(rows, HIDDEN, generator=gen)
    w = torch.randn(HIDDEN, generator=gen)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    q = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
    pos = torch.arange(rows, dtype=torch.int64)
    cos_sin = torch.randn(4096, HEAD_DIM, generator=gen)
    gate_up = torch.randn(rows, 2 * INTER, generator=gen)
    return {
        "rms_norm + residual": lambda: ops.rms_norm(x, w, 1e-5, res),  # type: ignore[attr-defined]
        "rotary q+k": lambda: ops.rotary(q, k, pos, cos_sin),  # type: ignore[attr-defined]
        "silu_and_mul": lambda: ops.silu_and_mul(gate_up),  # type: ignore[attr-defined]
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,256")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--baseline", default=None, help="git revision of kernels/csrc to compare")
    args = ap.parse_args()
    impls: dict[str, object] = {"torch": TorchOps()}
    if args.baseline:
        impls[f"C++ at {args.baseline}"] = load_at_revision(args.baseline)
    impls["C++ (this tree)"] = load_cpu_ops(ext_cache_dir())
    names = list(impls)
    print(f"threads={torch.get_num_threads()}, fp32, best of {args.repeat} (us per call)")
    print("| op | rows | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            per_impl = {name: cases(impl, rows) for name, impl in impls.items()}
            for op in per_impl["torch"]:
                cells = [f"{best_ms(per_impl[n][op], args.repeat) * 1e3:.1f}" for n in names]
                print(f"| {op} | {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
