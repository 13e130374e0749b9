"""Conveyor's C++ CPU kernels (kernels/csrc/*.cpp): build once per machine, load, launch.

The extension is compiled with torch.utils.cpp_extension (ninja from the venv) for the CPU it
runs on (-march=native), so its build folder is keyed by what changes the binary: the CPU model
and flags, the torch version, the compiler flags and every source and header in kernels/csrc
(the .cpp files are compiled together into one module; cpu_ops.h declares what it binds), and
where those sources lie: torch's build records their paths and rebuilds when they change, so
two checkouts on one machine sharing a folder would rebuild it for each other. A second
process (or a second worker rank) finds the build done and only imports it; torch's own file
lock keeps two processes from building at once.

Launchers check shapes and dtypes (ValueError naming the argument) before the C++ code, which
trusts pointers. Each has a torch reference of the same function beside it:
`cpu_paged_attention` <-> `kernels.paged_attention.paged_attention_ref`, `cpu_write_kv` <->
`kernels.write_kv.write_kv_ref`, `cpu_rotary_write_kv` <-> `kernels.write_kv.rotary_write_kv_ref`.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).parent / "csrc"
# -march=native: the build is per machine (the key holds the CPU flags); -fopenmp enables the
# `omp simd` loops (threads come from at::parallel_for, i.e. torch's own pool)
CFLAGS = ("-O3", "-march=native", "-fopenmp")
CPU_DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 80, 96, 128)  # the head sizes paged_attention.cpp is instantiated for


def sources() -> list[Path]:
    """The .cpp files of the extension, in a stable order."""
    return sorted(CSRC.glob("*.cpp"))


def headers() -> list[Path]:
    """The headers the sources include (part of the build key: a change rebuilds)."""
    return sorted(CSRC.glob("*.h"))


def cpu_identity() -> str:
    """CPU model name and flags (from /proc/cpuinfo; the platform string where unreadable)."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == platform.processor():
                model = value.strip()
            elif key.strip() == "flags":
                flags = value.strip()
                break
    except OSError:
        pass
    return f"{model}|{flags}"


def build_key() -> str:
    """Hex digest naming the build folder: CPU, torch version, flags, the sources' folder,
    sources and headers."""
    h = hashlib.sha256()
    for part in (cpu_identity(), torch.__version__, " ".join(CFLAGS), str(CSRC.resolve())):
        h.update(part.encode())
        h.update(b"\0")
    for path in sources() + headers():
        h.update(path.name.encode())
        h.update(b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


_LOADED: dict[Path, ModuleType] = {}  # build folder -> the module imported from it


def load_cpu_ops(cache_dir: Path, verbose: bool = False) -> ModuleType:
    """Build (first time on this machine) and import the extension from `cache_dir/<key>`,
    once per process (a second call returns the same module). Raises (RuntimeError, OSError,
    ...) when it cannot be built; callers decide what to do."""
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    key = build_key()
    folder = cache_dir / key
    if folder in _LOADED:
        return _LOADED[folder]
    folder.mkdir(parents=True, exist_ok=True)
    _LOADED[folder] = load(
        name=f"conveyor_cpu_ops_{key}",
        sources=[str(path) for path in sources()],
        extra_cflags=list(CFLAGS),
        build_directory=str(folder),
        verbose=verbose,
    )
    return _LOADED[folder]


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the venv's ninja package sits beside the interpreter, which
    is not on PATH when the venv is not activated (make, the launcher)."""
    try:
        import ninja  # the PyPI package: ships the binary in ninja.BIN_DIR
    except ImportError:
        return
    bin_dir = str(ninja.BIN_DIR)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path


def cpu_paged_attention(
    ext: ModuleType,
    q: torch.Tensor,  # [T, H, D], unit stride on D (views of the fused qkv output are fine)
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] contiguous
    v_cache: torch.Tensor,  # [N, bs, Hkv, D] contiguous
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32, cached + new tokens per sequence
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
) -> torch.Tensor:  # [T, H, D], q's dtype
    """Causal paged attention over a mixed step, reading K/V in place (semantics: the module
    doc of kernels.paged_attention; reference: paged_attention_ref). The C++ side checks shapes,
    dtypes and strides (ValueError); lengths and block-table entries are trusted, as in the
    Triton kernel. Called once per layer per step, so the checks stay in C++ (no Python cost)."""
    return ext.paged_attention(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, float(scale)
    )


def cpu_write_kv(
    ext: ModuleType,
    key: torch.Tensor,  # [T, Hkv, D] float32 or bfloat16, unit stride on D
    value: torch.Tensor,  # [T, Hkv, D], key's dtype
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] contiguous, float32 / bfloat16 / float16
    v_cache: torch.Tensor,  # the same
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """K and V of each token into slot `slot_mapping[t]` of the caches, in one call (rounded to
    the cache's dtype as torch's .to() does). The C++ side checks shapes, dtypes and every slot
    (ValueError, before anything is written); 8-bit caches are not covered (the torch write)."""
    ext.write_kv(key, value, k_cache, v_cache, slot_mapping)


def cpu_rotary_write_kv(
    ext: ModuleType,
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) D] a layer's fused projection, unit stride on rows
    positions: torch.Tensor,  # [T] int64
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] as in cpu_write_kv
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> torch.Tensor:  # q [T, H, D], a view of qkv
    """Rotary on qkv's q and k heads in place, then its k and v rows into the cache: one call
    per layer for what rotary + write_kv do in two (Hkv, D from the cache; checks as
    cpu_write_kv, all before qkv is touched)."""
    return ext.rotary_write_kv(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
