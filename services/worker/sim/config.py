"""Configuration of the simulated worker (flags `--sim-*`, see `__main__.py`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from services.worker.sim.profiles import (
    DeviceProfile,
    ModelShape,
    get_device,
    get_model,
    load_device,
)

WEIGHT_DTYPE_BYTES = {"bfloat16": 2, "float8": 1}

# Emitted token ids stay below this by default: ordinary BPE tokens in both Llama-3's and
# SmolLM2's vocabularies, so the stack's real tokenizer can detokenize them whatever model the
# costs are modelled on.
DEFAULT_TOKEN_ID_HIGH = 32000
DEFAULT_TOKEN_ID_LOW = 256  # above the special and byte tokens of both vocabularies


@dataclass(frozen=True, slots=True)
class SimConfig:
    device: str = "h200"  # a name in profiles.DEVICES; ignored when profile_path is set
    model: str = "llama-3-8b"  # a name in profiles.MODELS
    profile_path: Optional[Path] = (
        None  # a device profile JSON (e.g. from `conveyor sim calibrate`)
    )
    weight_dtype: str = "bfloat16"  # "bfloat16" | "float8": bytes per weight
    block_size: int = 16  # tokens per KV block
    num_blocks: Optional[int] = None  # None: as many as fit in the device's memory
    max_model_len: Optional[int] = None  # None: the model's max positions, capped by the pool
    eos_probability: float = 0.0  # chance each output token is eos (0: lengths == max_tokens)
    token_id_low: int = DEFAULT_TOKEN_ID_LOW
    token_id_high: Optional[int] = None  # None: min(vocab size, DEFAULT_TOKEN_ID_HIGH)
    report_every: int = 200  # decode steps per num_seqs between "engine gap" log lines
    # devices of one tensor-parallel group this one process models (DeviceProfile.tensor_parallel)
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.weight_dtype not in WEIGHT_DTYPE_BYTES:
            raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPE_BYTES)}")
        if self.block_size <= 0:
            raise ValueError("block_size must be > 0")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("num_blocks must be > 0 (or unset: derived from device memory)")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("max_model_len must be > 0")
        if not 0.0 <= self.eos_probability < 1.0:
            raise ValueError("eos_probability must be in [0, 1)")
        if self.token_id_low < 0:
            raise ValueError("token_id_low must be >= 0")
        if self.token_id_high is not None and self.token_id_high <= self.token_id_low + 1:
            raise ValueError("token_id_high must exceed token_id_low + 1")
        if self.report_every <= 0:
            raise ValueError("report_every must be > 0")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        shape = get_model(self.model)
        n = self.tensor_parallel_size
        if shape.num_heads % n or shape.num_kv_heads % n:
            raise ValueError(
                f"tensor_parallel_size {n} does not divide {self.model}'s {shape.num_heads} "
                f"query heads and {shape.num_kv_heads} KV heads"
            )

    def device_profile(self) -> DeviceProfile:
        """The named device, or the profile file when one is given."""
        one = load_device(self.profile_path) if self.profile_path else get_device(self.device)
        return one.tensor_parallel(self.tensor_parallel_size)

    def model_shape(self) -> ModelShape:
        shape = get_model(self.model)
        return dataclasses.replace(
            shape, weight_bytes_per_param=WEIGHT_DTYPE_BYTES[self.weight_dtype]
        )
