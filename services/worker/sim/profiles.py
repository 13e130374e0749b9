"""Named device and model profiles for the simulated worker (SIMULATED: no model runs).

A device profile holds *effective* rates: the datasheet peak times an assumed efficiency, because
no real kernel reaches its peak and the cost model is meant to predict real step times. The peaks
are cited beside each profile; the efficiencies are assumptions, documented in docs/simulator.md,
and can be replaced by a calibrated profile (`--sim-profile FILE`, written by `calibrate.py`).

A rate of `None` means "not a bottleneck": that term costs no time (the zero-cost profile `none`
sets every rate to None and every overhead to 0, so a run measures only the engine around it).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

GB = 1e9  # datasheets use decimal gigabytes
TERA = 1e12


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """What one accelerator (or this CPU) can do, as the cost model sees it."""

    name: str
    dense_flops: Optional[float]  # FLOP/s of the linear layers (GEMMs); None: free
    attention_flops: Optional[float]  # FLOP/s of attention (QK^T and PV); None: free
    bandwidth: Optional[float]  # bytes/s of device memory; None: free
    memory_bytes: int  # device memory for weights + KV cache + activations
    launch_s: float = 0.0  # fixed cost of a step: kernel launches, sampling, host work
    per_seq_s: float = 0.0  # extra cost per scheduled sequence (per-sequence host work)
    memory_utilization: float = 0.9  # fraction of memory_bytes weights + KV may use
    source: str = ""  # where the numbers come from (datasheet or calibration run)
    # bytes/s of KV cache traffic: a GPU reads it at `bandwidth`; the CPU worker first copies
    # every sequence's blocks into one tensor, a slower pass; None: free
    kv_bandwidth: Optional[float] = None
    # Terms a CPU needs and a GPU does not (docs/simulator.md, "CPU terms"); their defaults
    # leave a profile a plain roofline:
    # bytes/s of the extra pass over the weights a matrix-matrix product makes (CPU BLAS packs
    # the weight matrix; a one-token step runs matrix-vector kernels without it); None: no pass
    pack_bandwidth: Optional[float] = None
    prefill_step_s: float = 0.0  # fixed extra cost of a step holding a prompt chunk (> 1 token)
    # Tensor parallelism (`tensor_parallel`): ranks this profile stands for, and each rank's
    # interconnect as one ring all-reduce sees it (bytes/s one way; None: no interconnect
    # known) plus the fixed latency of one collective
    tensor_parallel_size: int = 1
    link_bandwidth: Optional[float] = None
    link_latency_s: float = 0.0

    def __post_init__(self) -> None:
        for rate in ("dense_flops", "attention_flops", "bandwidth", "kv_bandwidth",
                     "pack_bandwidth"):  # fmt: skip
            value = getattr(self, rate)
            if value is not None and not value > 0:
                raise ValueError(f"device {self.name}: {rate} must be > 0 or None (free)")
        if self.memory_bytes <= 0:
            raise ValueError(f"device {self.name}: memory_bytes must be > 0")
        if self.launch_s < 0 or self.per_seq_s < 0 or self.prefill_step_s < 0:
            raise ValueError(f"device {self.name}: overheads must be >= 0")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"device {self.name}: memory_utilization must be in (0, 1]")
        if self.tensor_parallel_size < 1 or self.link_latency_s < 0:
            raise ValueError(f"device {self.name}: tensor_parallel_size >= 1, latency >= 0")
        if self.link_bandwidth is not None and not self.link_bandwidth > 0:
            raise ValueError(f"device {self.name}: link_bandwidth must be > 0 or None")

    def tensor_parallel(self, n: int) -> DeviceProfile:
        """N of these devices as one tensor-parallel group: every rate and the memory N times
        (each rank does 1/N of the FLOPs and reads 1/N of the weights and KV), plus the
        all-reduce term of the cost model (cost_model.step_cost). ValueError when the profile
        has no interconnect figures (a CPU profile, a calibrated file without them)."""
        if n == 1:
            return self
        if self.link_bandwidth is None and not self.zero_cost:
            raise ValueError(f"device {self.name} has no interconnect figures for N={n} ranks")

        def times(rate: Optional[float]) -> Optional[float]:
            return None if rate is None else rate * n

        return dataclasses.replace(
            self,
            name=f"{self.name}x{n}",
            dense_flops=times(self.dense_flops),
            attention_flops=times(self.attention_flops),
            bandwidth=times(self.bandwidth),
            kv_bandwidth=times(self.kv_bandwidth),
            pack_bandwidth=times(self.pack_bandwidth),
            memory_bytes=self.memory_bytes * n,
            tensor_parallel_size=n,
        )

    @property
    def zero_cost(self) -> bool:
        """True when every step costs exactly 0 s (the `none` profile)."""
        rates = (self.dense_flops, self.attention_flops, self.bandwidth, self.kv_bandwidth,
                 self.pack_bandwidth)  # fmt: skip
        overheads = (self.launch_s, self.per_seq_s, self.prefill_step_s)
        return all(r is None for r in rates) and all(o == 0 for o in overheads)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder-only Llama-style transformer: what its cost depends on."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    max_position: int
    eos_token_ids: list[int] = field(default_factory=list)
    weight_bytes_per_param: float = 2.0  # bf16; a quantized format's bytes (q4_1: 0.625)
    kv_bytes_per_elem: int = 2  # bf16 KV cache

    def __post_init__(self) -> None:
        sizes = (
            self.num_layers,
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.vocab_size,
            self.max_position,
            self.kv_bytes_per_elem,
        )
        if any(not isinstance(s, int) or s <= 0 for s in sizes):
            raise ValueError(f"model {self.name}: every size must be a positive integer")
        if not self.weight_bytes_per_param > 0:
            raise ValueError(f"model {self.name}: weight_bytes_per_param must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_heads must be a multiple of num_kv_heads")

    @property
    def linear_params_per_layer(self) -> int:
        """q, k, v, o projections and the gated MLP (gate, up, down) of one layer."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o; k, v
        return attn + 3 * h * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters: embeddings, layers (with their two norms), final norm, LM head."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_embeddings else self.lm_head_params
        per_layer = self.linear_params_per_layer + 2 * self.hidden_size
        return embed + head + self.num_layers * per_layer + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return int(self.num_params * self.weight_bytes_per_param)

    @property
    def step_weight_bytes(self) -> int:
        """Weights one step reads: every layer's linear weights and the LM head."""
        params = self.num_layers * self.linear_params_per_layer + self.lm_head_params
        return int(params * self.weight_bytes_per_param)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        elems = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return elems * self.kv_bytes_per_elem


# Effective fraction of the datasheet peak a well-tuned serving stack reaches. Assumptions, not
# measurements: dense GEMMs at serving shapes typically reach 50-70% of peak, memory-bound
# decode kernels 70-85% of peak bandwidth.
GPU_COMPUTE_EFFICIENCY = 0.6
GPU_ATTENTION_EFFICIENCY = 0.4
GPU_BANDWIDTH_EFFICIENCY = 0.8
GPU_LAUNCH_S = 1.5e-3  # per-step launches + sampling + host work without CUDA graphs
# NVLink as a ring all-reduce sees it. H100/H200 SXM: NVLink 4, 900 GB/s per GPU in total, i.e.
# 450 GB/s each way (NVIDIA H100 and H200 datasheets; HGX boards join 8 GPUs through NVSwitch,
# so every GPU has its full link in a ring). A100 SXM: NVLink 3, 600 GB/s -> 300 GB/s each
# way. Assumptions, not measurements: NCCL's all-reduce bus bandwidth reaches ~80% of the link
# (nccl-tests busbw on 8 x H100 is reported at 360-480 GB/s for large messages), and a small
# all-reduce costs ~10 us of latency on 8 GPUs (decode-sized messages are latency-bound).
NVLINK_EFFICIENCY = 0.8
NVLINK_LATENCY_S = 10e-6


def _gpu(
    name: str,
    bf16_dense: float,
    bandwidth: float,
    memory: float,
    source: str,
    nvlink_one_way: float,
) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        dense_flops=bf16_dense * GPU_COMPUTE_EFFICIENCY,
        attention_flops=bf16_dense * GPU_ATTENTION_EFFICIENCY,
        bandwidth=bandwidth * GPU_BANDWIDTH_EFFICIENCY,
        kv_bandwidth=bandwidth * GPU_BANDWIDTH_EFFICIENCY,  # paged attention reads HBM directly
        memory_bytes=int(memory),
        launch_s=GPU_LAUNCH_S,
        per_seq_s=0.0,
        source=source,
        link_bandwidth=nvlink_one_way * NVLINK_EFFICIENCY,
        link_latency_s=NVLINK_LATENCY_S,
    )


DEVICES: dict[str, DeviceProfile] = {
    # NVIDIA H200 SXM datasheet (nvidia.com/en-us/data-center/h200/): 141 GB HBM3e, 4.8 TB/s,
    # BF16 Tensor Core 1,979 TFLOPS *with sparsity* -> 989.5 TFLOPS dense.
    "h200": _gpu("h200", 989.5 * TERA, 4.8e12, 141 * GB, "NVIDIA H200 SXM datasheet", 450 * GB),
    # NVIDIA H100 SXM datasheet (nvidia.com/en-us/data-center/h100/): 80 GB HBM3, 3.35 TB/s,
    # BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989.5 TFLOPS dense.
    "h100": _gpu("h100", 989.5 * TERA, 3.35e12, 80 * GB, "NVIDIA H100 SXM datasheet", 450 * GB),
    # NVIDIA A100 80GB SXM datasheet (nvidia.com/en-us/data-center/a100/): 80 GB HBM2e,
    # 2,039 GB/s, BF16 Tensor Core 312 TFLOPS dense (624 with sparsity).
    "a100": _gpu("a100", 312 * TERA, 2.039e12, 80 * GB, "NVIDIA A100 80GB SXM datasheet", 300 * GB),
    # This machine's 2 cores running the real worker on SmolLM2-135M in fp32 (2 threads),
    # calibrated: `conveyor sim measure` (24 shapes x 9 steps, 2026-11-30) then `conveyor sim
    # calibrate` -> max error 12.2% over decodes at B = 1-32 (contexts 129 and 513), prefills of
    # 16-2,048 tokens and mixed steps (docs/PERFORMANCE.md §6). launch_s holds the one weight
    # read every step makes (matrix-vector at one token); pack_bandwidth the extra pass of
    # matrix-matrix kernels; kv_bandwidth the block gather before attention. Recalibrate on any
    # other machine.
    "cpu-smollm2": DeviceProfile(
        name="cpu-smollm2",
        dense_flops=85.0e9,
        attention_flops=95.3e9,
        bandwidth=None,
        # ~ the real worker's default 1 GiB KV pool once weights and the reserve are taken.
        memory_bytes=int(1.45 * GB),
        memory_utilization=1.0,
        launch_s=99.6e-3,
        per_seq_s=4.55e-3,
        kv_bandwidth=1.42e9,
        pack_bandwidth=3.61e9,
        prefill_step_s=39.5e-3,
        source="calibrated on this 2-core machine (docs/PERFORMANCE.md §6)",
    ),
    # Zero cost: every step returns at once. Memory as an H200's so KV capacity is realistic.
    "none": DeviceProfile(
        name="none",
        dense_flops=None,
        attention_flops=None,
        bandwidth=None,
        memory_bytes=int(141 * GB),
        source="zero-cost profile: measures the engine, not a device",
    ),
}

# Llama 3.1 end of sequence: <|end_of_text|>, and the Instruct models' <|eom_id|>, <|eot_id|>
LLAMA_3_1_EOS = (128001, 128008, 128009)

MODELS: dict[str, ModelShape] = {
    # meta-llama/Meta-Llama-3-8B config.json: 32 layers, hidden 4096, MLP 14336, 32 heads,
    # 8 KV heads, vocab 128256, untied, max_position_embeddings 8192; eos <|end_of_text|> 128001,
    # <|eot_id|> 128009 (the Instruct model's end of turn).
    "llama-3-8b": ModelShape(
        "llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256, False, 8192, [128001, 128009]
    ),
    # meta-llama/Meta-Llama-3-70B config.json: 80 layers, hidden 8192, MLP 28672, 64 heads,
    # 8 KV heads. In bf16 (141 GB of weights) it fits no single device here: use
    # --sim-weight-dtype float8 (70 GB).
    "llama-3-70b": ModelShape(
        "llama-3-70b", 80, 8192, 28672, 64, 8, 128, 128256, False, 8192, [128001, 128009]
    ),
    # meta-llama/Llama-3.1-405B(-Instruct) config.json: 126 layers, hidden 16384, MLP 53248,
    # 128 heads, 8 KV heads, head_dim 128, vocab 128256, untied, max_position_embeddings 131072
    # (llama3 RoPE scaling); eos 128001, and the Instruct model's 128008 <|eom_id|> and 128009
    # <|eot_id|>. bf16 weights (811 GB) need 8 H200s: use --sim-weight-dtype float8 (406 GB).
    "llama-3.1-405b": ModelShape(
        "llama-3.1-405b", 126, 16384, 53248, 128, 8, 128, 128256, False, 131072, [*LLAMA_3_1_EOS]
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct (FACTS.md): 30 layers, hidden 576, MLP 1536, 9 heads,
    # 3 KV heads, head_dim 64, vocab 49152, tied embeddings, 8192 positions; eos <|im_end|> = 2.
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152, True, 8192, [2]),
}


def get_device(name: str) -> DeviceProfile:
    if name not in DEVICES:
        raise ValueError(f"unknown simulated device {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[name]


def get_model(name: str) -> ModelShape:
    if name not in MODELS:
        raise ValueError(f"unknown simulated model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def device_from_dict(data: dict[str, Any]) -> DeviceProfile:
    """A profile from its JSON form; unknown keys are an error (a typo must not pass silently)."""
    known = {f.name for f in fields(DeviceProfile)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown device profile keys: {', '.join(sorted(unknown))}")
    return DeviceProfile(**data)


def load_device(path: Path) -> DeviceProfile:
    """Read a profile JSON written by `conveyor sim calibrate` (or by hand)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read device profile {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"device profile {path} must hold a JSON object")
    return device_from_dict(data)
