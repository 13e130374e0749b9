"""Configuration of the simulated worker (flags `--sim-*`: shared/config_flags.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

from services.worker.sim.kv_link import KV_LINKS, KV_READS
from services.worker.sim.profiles import (
    DEVICES,
    MODELS,
    DeviceProfile,
    ModelShape,
    get_device,
    get_model,
    load_device,
)

# Bytes per weight a step reads: float formats, and the quantized ones the real worker serves
# (services/worker/linear.py; GGUF blocks of 32 weights with their fp16 scales: q4_0 18 bytes,
# q4_1 20, q8_0 34; int8 per output channel).
WEIGHT_DTYPE_BYTES: dict[str, float] = {
    "float32": 4.0, "bfloat16": 2.0, "float8": 1.0, "int8": 1.0,
    "q8_0": 34 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32,
}  # fmt: skip

# Emitted token ids stay below this by default: ordinary BPE tokens in both Llama-3's and
# SmolLM2's vocabularies, so the stack's real tokenizer can detokenize them whatever model the
# costs are modelled on.
DEFAULT_TOKEN_ID_HIGH = 32000
DEFAULT_TOKEN_ID_LOW = 256  # above the special and byte tokens of both vocabularies


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What the simulated worker models; its flags are `--sim-*` (and --tensor-parallel-size)."""

    flag_prefix: ClassVar[str] = "sim_"

    device: str = field(
        default="h200",
        metadata={"choices": tuple(sorted(DEVICES)),
                  "help": "simulated device profile (ignored with --sim-profile)"},
    )  # fmt: skip
    model: str = field(
        default="llama-3-8b",
        metadata={"choices": tuple(sorted(MODELS)), "help": "simulated model shape"},
    )
    profile_path: Optional[Path] = field(
        default=None,
        metadata={"flag": "sim_profile",
                  "help": "a device profile JSON (`conveyor sim calibrate`); beats --sim-device"},
    )  # fmt: skip
    weight_dtype: str = field(
        default="bfloat16",
        metadata={"choices": tuple(sorted(WEIGHT_DTYPE_BYTES)), "help": "bytes per weight"},
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_blocks: Optional[int] = field(
        default=None,
        metadata={"help": "KV blocks to report (none: what fits in the device's memory)"},
    )
    max_model_len: Optional[int] = field(
        default=None,
        metadata={"help": "longest sequence (none: the model's, capped by the KV pool)"},
    )
    eos_probability: float = field(
        default=0.0,
        metadata={"help": "chance each output token is end-of-sequence (0: lengths == max_tokens)"},
    )
    # speculative decoding, SIMULATED (docs/design/speculation.md): with a rate the worker
    # proposes every draft the plan allows, each the token the request gets at that index with
    # this chance (a deterministic draw per request and index), else another one
    spec_acceptance: Optional[float] = field(
        default=None,
        metadata={"help": "SIMULATED speculative decoding: the chance each draft is accepted "
                  "(none: the worker does not speculate)"},
    )  # fmt: skip
    # the KV hand-over's link between a prefill and a decode device (sim/kv_link.py)
    kv_link: str = field(
        default="infiniband",
        metadata={"choices": tuple(KV_LINKS),
                  "help": "SIMULATED link a KV hand-over crosses: nvlink (one node), "
                  "infiniband (400 Gb/s per GPU), ethernet (100 Gb/s), free"},
    )  # fmt: skip
    # when a simulated prefill worker answers KV reads: "one-sided", during its steps, with
    # the lease grants taken out of the plan stream (a one-sided RDMA read, NIXL: no prefill
    # compute, its lease checked off the step); "two-sided", between its steps (what the real
    # Python worker does: a read waits for the step in progress); "auto": the link's way
    kv_reads: str = field(
        default="auto",
        metadata={"choices": KV_READS,
                  "help": "SIMULATED: when the prefill worker answers KV reads: one-sided "
                  "(during its steps, an RDMA read), two-sided (between them, as the real "
                  "worker), auto (one-sided on nvlink/infiniband/free links)"},
    )  # fmt: skip
    token_id_low: int = field(
        default=DEFAULT_TOKEN_ID_LOW, metadata={"help": "emitted token ids start here"}
    )
    token_id_high: Optional[int] = field(
        default=None,
        metadata={"help": "emitted token ids stay below this (none: min(vocabulary size, "
                  f"{DEFAULT_TOKEN_ID_HIGH}))"},
    )  # fmt: skip
    # Real devices do not take the same time twice (clocks, other work, the host): a relative
    # step-time noise, each step's modelled time times a factor ~ lognormal(0, step_noise)
    step_noise: float = field(
        default=0.0,
        metadata={"help": "relative step-time noise (sd of a lognormal factor; 0: exact model)"},
    )
    report_every: int = field(
        default=200,
        metadata={"help": "decode steps per batch size between engine-gap log lines"},
    )
    # devices of one tensor-parallel group this one process models (DeviceProfile.tensor_parallel)
    tensor_parallel_size: int = field(
        default=1,
        metadata={"flag": "tensor_parallel_size",
                  "help": "model N devices of one tensor-parallel group in this one process "
                  "(their all-reduces over the device's interconnect)"},
    )  # fmt: skip
    # Fault injection (services/worker/sim/faults.py, wrapped around the runner by __main__)
    fail_token: Optional[int] = field(
        default=None,
        metadata={"internal": True, "help": "fault injection: steps holding a request whose "
                  "prompt contains this token id fail"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if not isinstance(self.step_noise, (int, float)) or not 0.0 <= self.step_noise <= 1.0:
            raise ValueError("step_noise must be in [0, 1]")
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
        if self.spec_acceptance is not None and not 0.0 <= self.spec_acceptance <= 1.0:
            raise ValueError("spec_acceptance must be in [0, 1]")
        if self.kv_link not in KV_LINKS:
            raise ValueError(f"kv_link must be one of {', '.join(KV_LINKS)}")
        if self.kv_reads not in KV_READS:
            raise ValueError(f"kv_reads must be one of {', '.join(KV_READS)}")
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

    def one_sided_reads(self) -> bool:
        """Whether KV reads are answered during steps (`kv_reads`, or its link's way)."""
        if self.kv_reads == "auto":
            return KV_LINKS[self.kv_link].one_sided
        return self.kv_reads == "one-sided"

    def device_profile(self) -> DeviceProfile:
        """The named device, or the profile file when one is given."""
        one = load_device(self.profile_path) if self.profile_path else get_device(self.device)
        return one.tensor_parallel(self.tensor_parallel_size)

    def model_shape(self) -> ModelShape:
        shape = get_model(self.model)
        return dataclasses.replace(
            shape, weight_bytes_per_param=WEIGHT_DTYPE_BYTES[self.weight_dtype]
        )
