"""Worker settings: one frozen dataclass, validated when built (ValueError, never assert)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from shared.env import env_str
from shared.model_files import prepare_model, read_config

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
# "auto": bfloat16 on CUDA; on CPU the faster of bfloat16 and float32 on the model's own GEMMs,
# measured once per machine (services/worker/dtype_probe.py): flag names cannot tell, and the
# gap is large both ways (AVX2-only EPYC: bf16 ~5x slower; AMX Xeon: bf16 ~6x faster).
DEFAULT_DTYPE = "auto"
PIPELINE_MODES = ("auto", "on", "off")
SPECULATIVE_MODES = ("off", "ngram", "draft")
# Weights (services/worker/linear.py): "auto" serves a GGUF's own Q4_0/Q4_1/Q8_0 blocks (other
# block formats as Q8_0) and an unquantized checkpoint as it is; "none" the dequantized tensors in
# the compute dtype; a block format requantizes every linear layer to it; "int8" int8 weights
# with an fp16 scale per 32 along K (services/worker/int8_linear.py).
QUANTIZATIONS = ("auto", "none", "q4_0", "q4_1", "q8_0", "int8")
BLOCK_FORMATS = ("q4_0", "q4_1", "q8_0")
# KV cache storage (services/worker/kv_cache.py); attention computes in fp32 on the CPU.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")
DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB: ~46k SmolLM2 tokens in bf16, small on a 24 GiB host


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: Optional[str] = field(
        default=None,  # prepare_model's spec
        metadata={"help": "'smollm2' (none: the default), a .gguf file or a Hugging Face folder"},
    )
    dtype: str = field(
        default=DEFAULT_DTYPE,  # "auto": see above
        metadata={"choices": DTYPES, "help": "weights, activations and the KV cache; auto: "
                  "bfloat16 on CUDA, on CPU the faster of the two on this machine"},
    )  # fmt: skip
    quantization: str = field(
        default="auto",
        metadata={"choices": QUANTIZATIONS, "help": "weights: auto serves a GGUF's own blocks "
                  "(Q4_0/Q4_1/Q8_0; other block formats as q8_0) and a Hugging Face folder as it "
                  "is; none: the dequantized weights in the compute dtype; q4_0/q4_1/q8_0: every "
                  "linear layer requantized to that format; int8: int8 weights, a scale per 32"},
    )  # fmt: skip
    kv_cache_dtype: str = field(
        default="auto",
        metadata={"choices": KV_CACHE_DTYPES, "help": "KV cache storage: auto = the compute "
                  "dtype; bfloat16/float16 halve an fp32 cache (twice the blocks in the same "
                  "memory); int8/fp8_e4m3 store 8-bit codes with a scale per token and KV head "
                  "(3.8x the blocks); attention computes in fp32 on the CPU"},
    )  # fmt: skip
    device: str = field(default="cpu", metadata={"help": "cpu, cuda or cuda:N"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_memory: Optional[int] = field(
        default=None, metadata={"help": "bytes for K and V of every layer"}
    )
    gpu_memory_utilization: Optional[float] = field(
        default=None,
        metadata={"help": "else the share of the device's memory this worker may use in all: "
                  "on CUDA of the GPU's total, the KV pool getting what the weights, a profiling "
                  "forward of --profile-num-tokens and memory outside torch leave; on CPU of the "
                  "memory available once the weights are loaded (none, and no --kv-cache-memory: "
                  "1 GiB)"},
    )  # fmt: skip
    profile_num_tokens: int = field(
        default=8192,
        metadata={"help": "tokens of the profiling forward that measures peak activation memory "
                  "under --gpu-memory-utilization on CUDA (at least the scheduler's "
                  "--max-num-batched-tokens)"},
    )  # fmt: skip
    max_model_len: Optional[int] = field(
        default=None, metadata={"help": "longest sequence (none: the model's max positions)"}
    )
    attention_backend: str = field(
        default="auto",
        metadata={"choices": ATTENTION_BACKENDS, "help": "auto: triton on CUDA; on CPU the C++ "
                  "extension (cpu), torch when it cannot be built"},
    )  # fmt: skip
    num_threads: Optional[int] = field(
        default=None,
        metadata={"help": "torch intra-op threads (none: torch's, capped at the CPUs)"},
    )
    # Speculative decoding (docs/design/speculation.md): the worker proposes, since it holds
    # the histories; the scheduler's --num-speculative-tokens bounds the drafts per step.
    speculative: Literal["off", "ngram", "draft"] = field(
        default="off",
        metadata={"choices": SPECULATIVE_MODES, "help": "speculative decoding: ngram proposes "
                  "the tokens that followed the last --ngram-n tokens earlier in the request's "
                  "own history (prompt lookup); draft runs --draft-model; greedy and seeded "
                  "text the same as off"},
    )  # fmt: skip
    ngram_n: int = field(
        default=3, metadata={"help": "tokens an n-gram proposal matches (--speculative ngram)"}
    )
    draft_model: Optional[str] = field(
        default=None,
        metadata={"help": "--speculative draft's model (other modes ignore it): a .gguf file or "
                  "a Hugging Face folder with the target's vocabulary; its KV pool has as many "
                  "blocks as the target's (the same block tables), its own bytes per block"},
    )  # fmt: skip
    # Not a user setting: the worker decides itself (services/worker/pipeline.py has the rule).
    pipeline_steps: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata={
            "internal": True,
            "help": "step pipelining (launch step N+1 before step N's tokens reach the host): "
            "auto decides from the device and the measured step (on a CUDA device with one "
            "rank, while the host's work to queue a step is at least 2 percent of its "
            "forward); on/off force it (tests: on a CPU 'on' only delays each result by a "
            "step; tensor parallelism refuses 'on')",
        },
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
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
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if self.kv_cache_memory is not None and util is not None:
            raise ValueError("give kv_cache_memory or gpu_memory_utilization, not both")
        if not _pos_int(self.profile_num_tokens):
            raise ValueError(
                f"profile_num_tokens must be an integer > 0, got {self.profile_num_tokens!r}"
            )
        if self.max_model_len is not None and not _pos_int(self.max_model_len):
            raise ValueError(f"max_model_len must be an integer > 0, got {self.max_model_len!r}")
        if self.num_threads is not None and not _pos_int(self.num_threads):
            raise ValueError(f"num_threads must be an integer > 0, got {self.num_threads!r}")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}")
        if self.speculative == "draft" and self.draft_model is None:
            raise ValueError("--speculative draft needs --draft-model")
        if not _pos_int(self.ngram_n):
            raise ValueError(f"ngram_n must be an integer > 0, got {self.ngram_n!r}")
        if self.pipeline_steps not in PIPELINE_MODES:
            raise ValueError(
                f"pipeline_steps must be one of {', '.join(PIPELINE_MODES)}, "
                f"got {self.pipeline_steps!r}"
            )


def pipelines_steps(config: WorkerConfig, world_size: int) -> bool:
    """Whether the worker runs its steps pipelined (launch, then finish; services/worker/
    steps.py `PipelinedSteps`), decided once at start: "auto" on a CUDA device with one rank,
    where each step then asks `OverlapRule` (services/worker/pipeline.py) whether launching
    ahead pays. ValueError for "on" with several ranks."""
    if config.pipeline_steps == "on" and world_size > 1:
        raise ValueError(
            "pipeline_steps=on needs a single rank: with tensor parallelism rank 0 shares each "
            "step's tokens from the host (use auto or off)"
        )
    if config.pipeline_steps == "auto":
        return config.device.startswith("cuda") and world_size == 1
    return config.pipeline_steps == "on"


def resolve_dtype(config: WorkerConfig) -> Optional[str]:
    """The concrete dtype for `config.dtype`, or None for "auto" on CPU without
    CONVEYOR_AUTO_DTYPE (then decided at start by services.worker.dtype_probe)."""
    if config.dtype != "auto":
        return config.dtype
    if config.device.startswith("cuda"):
        return "bfloat16"
    forced = env_str("AUTO_DTYPE")
    if forced is not None:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"CONVEYOR_AUTO_DTYPE must be float32 or bfloat16, got {forced!r}")
        return forced
    return None


def resolve_kv_cache_dtype(config: WorkerConfig, compute_dtype: str) -> str:
    """The KV cache's storage dtype: `kv_cache_dtype`, or the compute dtype for auto."""
    return compute_dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype


def resolve_quantization(config: WorkerConfig, has_gguf_blocks: bool) -> str:
    """What the weights become: "none", "gguf" (the file's own blocks: `auto` on a GGUF
    source), a block format, or "int8". `auto` on an unquantized checkpoint is "none". The
    block and int8 kernels are CPU kernels: ValueError for an explicit one on CUDA (`auto`
    then means "none")."""
    q = config.quantization
    on_cpu = config.device == "cpu"
    if q == "auto":
        return "gguf" if has_gguf_blocks and on_cpu else "none"
    if q != "none" and not on_cpu:
        raise ValueError(f"quantization={q} runs on the CPU only (use none or auto on CUDA)")
    return q


def _pos_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


MAX_DIST_TIMEOUT_S = 30.0  # a lost tensor-parallel rank must not hang the others longer
DEFAULT_DIST_INIT = "tcp://127.0.0.1:29500"


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """This rank's place in its tensor-parallel group (services/worker/parallel.py); flags
    --rank, --world-size, --dist-init, --dist-timeout, else CONVEYOR_RANK, ... ."""

    rank: int = field(
        default=0, metadata={"help": "this rank in its group (0 samples and answers)"}
    )
    world_size: int = field(default=1, metadata={"help": "ranks of the tensor-parallel group"})
    # The traffic is not authenticated: loopback, or a private network between hosts.
    dist_init: str = field(
        default=DEFAULT_DIST_INIT,
        metadata={"help": "tcp://HOST:PORT where the ranks meet (rank 0 listens; loopback or a "
                  "private network only)"},
    )  # fmt: skip
    dist_timeout: float = field(
        default=MAX_DIST_TIMEOUT_S,
        metadata={"help": "seconds (<= 30) for the rendezvous and every collective"},
    )

    def __post_init__(self) -> None:
        if not _pos_int(self.world_size):
            raise ValueError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {self.rank!r}")
        host, _, port = self.dist_init.removeprefix("tcp://").rpartition(":")
        if not self.dist_init.startswith("tcp://") or not host or not port.isdigit():
            raise ValueError(f"dist_init must be tcp://HOST:PORT, got {self.dist_init!r}")
        if not 0 < self.dist_timeout <= MAX_DIST_TIMEOUT_S:
            raise ValueError(
                f"dist_timeout must be in (0, {MAX_DIST_TIMEOUT_S:g}] seconds, "
                f"got {self.dist_timeout!r}"
            )


def check_divides(world_size: int, num_heads: int, num_kv_heads: int, intermediate: int) -> None:
    """ValueError naming the counts when `world_size` does not split the model evenly (called at
    start, before any rank joins the group, so a bad size fails fast on every rank)."""
    bad = [
        f"{what} = {n}"
        for what, n in (
            ("query heads", num_heads),
            ("KV heads", num_kv_heads),
            ("intermediate size", intermediate),
        )
        if n % world_size
    ]
    if bad:
        fits = [n for n in range(1, num_heads + 1) if not num_heads % n and not num_kv_heads % n]
        fits = [n for n in fits if not intermediate % n]
        raise ValueError(
            f"tensor-parallel size {world_size} does not divide the model's {', '.join(bad)} "
            f"(model: {num_heads} query heads, {num_kv_heads} KV heads): use one of "
            f"{', '.join(map(str, fits))}"
        )


def check_model_divides(model: Optional[str], world_size: int) -> None:
    """`check_divides` on the model's config.json, before torch is imported: a world size that
    does not split the model is refused in a moment, on every rank, before any rank joins."""
    cfg = read_config(prepare_model(model))
    heads = int(cfg["num_attention_heads"])
    check_divides(world_size, heads, int(cfg.get("num_key_value_heads") or heads),
                  int(cfg["intermediate_size"]))  # fmt: skip
