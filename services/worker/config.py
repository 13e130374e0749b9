"""Worker settings: one frozen dataclass, validated when built (ValueError, never assert)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from shared.env import env_str

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# "auto": bfloat16 on CUDA; on CPU bfloat16 only where the CPU has native bf16 matmuls
# (avx512_bf16 / amx_bf16: ~4x fp32 GEMM speed), else float32. Measured on an AVX2-only EPYC
# (no avx512): torch's bf16 GEMM runs at ~10 GFLOP/s against ~50 for fp32, and a 256-token
# prefill step takes 3.6 s in bf16 against 0.8 s in fp32.
DEFAULT_DTYPE = "auto"
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB: ~46k SmolLM2 tokens in bf16, small on a 24 GiB host


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: Optional[str] = None  # None/"smollm2", a .gguf file or an HF folder (prepare_model)
    dtype: str = DEFAULT_DTYPE  # weights, activations and the KV cache ("auto": see above)
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: Optional[int] = None  # bytes for K and V of every layer
    kv_cache_fraction: Optional[float] = None  # else this share of the device's free memory
    max_model_len: Optional[int] = None  # None: the model's max positions
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    num_threads: Optional[int] = None  # torch intra-op threads; None leaves torch's default

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not _pos_int(self.block_size):
            raise ValueError(f"block_size must be an integer > 0, got {self.block_size!r}")
        if self.kv_cache_memory is not None and not _pos_int(self.kv_cache_memory):
            raise ValueError(
                f"kv_cache_memory must be a byte count > 0, got {self.kv_cache_memory!r}"
            )
        if self.kv_cache_fraction is not None and not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction!r}")
        if self.kv_cache_memory is not None and self.kv_cache_fraction is not None:
            raise ValueError("give kv_cache_memory or kv_cache_fraction, not both")
        if self.max_model_len is not None and not _pos_int(self.max_model_len):
            raise ValueError(f"max_model_len must be an integer > 0, got {self.max_model_len!r}")
        if self.num_threads is not None and not _pos_int(self.num_threads):
            raise ValueError(f"num_threads must be an integer > 0, got {self.num_threads!r}")


def resolve_dtype(config: WorkerConfig) -> str:
    """The concrete dtype for `config.dtype` ("auto" resolved as described above; on CPU,
    CONVEYOR_AUTO_DTYPE replaces the machine's own choice)."""
    if config.dtype != "auto":
        return config.dtype
    if config.device.startswith("cuda"):
        return "bfloat16"
    forced = env_str("AUTO_DTYPE")
    if forced is not None:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"CONVEYOR_AUTO_DTYPE must be float32 or bfloat16, got {forced!r}")
        return forced
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def _pos_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0
