"""Compile every Triton kernel for a GPU that is not here, and report its resource usage.

The interpreter runs a kernel's Python, not the compiler: a kernel can pass every interpreter
test and still fail to compile (a tl.dot side under 16, a type that changes inside a loop).
Triton can compile ahead of time, down to a cubin, for a target named by hand; cuobjdump (in
the triton wheel) then reads registers and stack (register spills) of each kernel. This script
does that for the launch shapes the launchers choose on a GPU, with no GPU and no CUDA driver.

    python bench/gpu/compile.py [--arch 90] [--json]

Must run without TRITON_INTERPRET (the interpreter replaces the compiler); it removes it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
INT_POINTERS = {"query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"}
I64_POINTERS = {"slot_mapping_ptr", "positions_ptr"}
FP32_POINTERS = {"part_out_ptr", "part_ml_ptr", "cos_sin_ptr", "lut_ptr"}
KV_POINTERS = {"k_cache_ptr", "v_cache_ptr"}
# an 8-bit KV cache's storage type by the attention's KV_CODES (kernels/kv_quant.py)
KV_CODE_TYPES = {1: "*i8", 2: "*u8"}
FLOAT_SCALARS = {"scale_log2", "eps"}


def _attention(group: int, head_dim: int, block_m: int, tile_n: int, splits: int,
               upcast: bool, kv_codes: int = 0) -> dict[str, Any]:  # fmt: skip
    return dict(KV_CODES=kv_codes,
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16, BLOCK_M=block_m,
        BLOCK_Q=block_m // group, TILE_N=tile_n, SEQS_PAD=64, NUM_SPLITS=splits,
        UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32",
    )  # fmt: skip


ATTN = ("kernels.paged_attention", "_unified_attention_kernel")
# (label, (module, kernel), element type, constexprs, num_warps): the GPU defaults of
# kernels/paged_attention_shape.py (launch_shape, num_warps) and the other launchers.
CASES: list[tuple[str, tuple[str, str], str, dict[str, Any], int]] = [
    ("attention decode d64 bf16", ATTN, "bf16", _attention(4, 64, 16, 64, 1, False), 4),
    ("attention decode d128 fp16 split", ATTN, "fp16", _attention(4, 128, 16, 64, 4, False), 4),
    ("attention prefill d128 bf16", ATTN, "bf16", _attention(4, 128, 64, 64, 1, False), 8),
    ("attention prefill d64 g3 bf16", ATTN, "bf16", _attention(3, 64, 64, 64, 1, False), 4),
    ("attention decode d64 g8 fp32", ATTN, "fp32", _attention(8, 64, 16, 64, 1, True), 4),
    ("attention decode d64 bf16 kv int8", ATTN, "bf16", _attention(4, 64, 16, 64, 1, False, 1), 4),
    ("attention prefill d64 bf16 kv fp8", ATTN, "bf16", _attention(4, 64, 64, 64, 1, False, 2), 4),
    ("merge splits d128", ("kernels.paged_attention", "_merge_splits_kernel"), "fp16",
     dict(HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SPLITS=4, SPLITS_PAD=4), 4),
    ("write_kv", ("kernels.write_kv", "_write_kv_kernel"), "bf16",
     dict(NUM_KV_HEADS=8, HEAD_DIM=64, HEADS_PAD=8, HEAD_DIM_PAD=64, BLOCK_SIZE=16,
          KV_CODES=0), 4),
    ("write_kv kv int8", ("kernels.write_kv", "_write_kv_kernel"), "bf16",
     dict(NUM_KV_HEADS=8, HEAD_DIM=64, HEADS_PAD=8, HEAD_DIM_PAD=64, BLOCK_SIZE=16,
          KV_CODES=1), 4),
    ("rms_norm +residual 2048", ("kernels.rms_norm", "_rms_norm_kernel"), "bf16",
     dict(HAS_RESIDUAL=True, BLOCK=2048), 4),
    ("rotary 32/8 heads d64", ("kernels.rotary", "_rotary_kernel"), "bf16",
     dict(HALF=32, HEADS_PAD=32, KV_HEADS_PAD=8, HALF_PAD=32), 4),
    ("silu_and_mul", ("kernels.silu_and_mul", "_silu_and_mul_kernel"), "bf16",
     dict(BLOCK=1024), 4),
]  # fmt: skip


def _signature(fn: Any, dtype: str, constexprs: dict[str, Any]) -> dict[str, str]:
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INT_POINTERS:
            signature[name] = "*i32"
        elif name in I64_POINTERS:
            signature[name] = "*i64"
        elif name in FP32_POINTERS:
            signature[name] = "*fp32"
        elif name in KV_POINTERS and constexprs.get("KV_CODES"):
            signature[name] = KV_CODE_TYPES[constexprs["KV_CODES"]]
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return signature


def _attrs(fn: Any, constexprs: dict[str, Any]) -> dict[tuple[int, ...], list]:
    # What Triton's JIT specializes at launch: 16-byte-aligned pointers and integers that are
    # multiples of 16 (strides of [.., heads, head_dim] tensors, hidden sizes) are marked
    # divisible by 16, which lets the compiler vectorize loads. Row counts and the block-table
    # stride are left unmarked: they are arbitrary at run time, and so are an 8-bit cache's
    # strides (rows of head_dim codes and a 4-byte scale).
    marked = []
    kv_rows = ("stride_k", "stride_v") if constexprs.get("KV_CODES") else ()
    for i, name in enumerate(fn.arg_names):
        if name in constexprs or name in ("stride_bt", "num_seqs", "num_slots", "max_pos"):
            continue
        if kv_rows and name.startswith(kv_rows):
            continue
        if name.endswith("_ptr") or name.startswith("stride_") or name in ("hidden", "inter"):
            marked.append(i)
    return {(i,): [["tt.divisibility", 16]] for i in marked}


def compile_case(arch: int, where: tuple[str, str], dtype: str, constexprs: dict[str, Any],
                 num_warps: int) -> dict[str, Any]:  # fmt: skip
    """Compile one kernel to a cubin; its registers and stack bytes per thread."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(where[0]), where[1])
    src = ASTSource(fn, _signature(fn, dtype, constexprs), constexprs, _attrs(fn, constexprs))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps})  # fmt: skip
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    if regs is None or stack is None:
        raise RuntimeError(f"unexpected cuobjdump output: {usage[-500:]}")
    return {"registers": int(regs.group(1)), "stack_bytes": int(stack.group(1))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="compile every kernel for a GPU, report usage")
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("gpu_compile: unset TRITON_INTERPRET (the interpreter replaces the compiler)")
        return 2
    sys.path.insert(0, str(ROOT))
    results: dict[str, Any] = {}
    for label, where, dtype, constexprs, num_warps in CASES:
        try:
            results[label] = compile_case(args.arch, where, dtype, constexprs, num_warps)
        except Exception as e:  # noqa: BLE001 - a failed compile is this script's finding
            results[label] = {"error": f"{type(e).__name__}: {e}"[:800]}
    if args.json:
        print(json.dumps(results))
    else:
        for label, r in results.items():
            print(f"{label:36} {r.get('error') or r}")
    failed = [r for r in results.values() if "error" in r or r["stack_bytes"] > 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
