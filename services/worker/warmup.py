"""Start-up compilation of every Triton variant the GPU worker launches, and a watch on later ones.

Triton compiles a kernel on the first launch of each variant (constexprs, dtypes, what it
specializes of the other arguments: kernels/launch.py), ~1.5 s each on a GPU while the device
idles. The kernels keep their variants to a small fixed set (kernels/paged_attention_shape.py
buckets, `do_not_specialize` on the per-step integers), so the worker compiles them all before
it reports ready: one forward of a short prompt (every small kernel, both norm variants, the
linear layers' libraries) and one paged-attention launch per (rows per program, KV splits)
bucket. `CompileWatch` then counts every compile (Triton's post-compile hook) and logs any that
happens while serving, which on a GPU should be none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kernels.paged_attention import paged_attention
from kernels.paged_attention_shape import BLOCK_M_BUCKETS, gpu_variants
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KVCache
from services.worker.kv_sizing import profile_step
from services.worker.model import LlamaModel, split_qkv
from services.worker.ops_triton import TritonOps

PROMPT_LEN = 16  # tokens of the warm-up forward and of the prefill-shaped attention launch
CONTEXT_LEN = 256  # keys of each attention launch (a few tiles per split)


@dataclass(frozen=True, slots=True)
class AttentionCase:
    """One warm-up attention launch: one sequence, its inputs built as a step builds them."""

    q: torch.Tensor  # [T, H, D], a view of a [T, (H + 2 Hkv) D] projection like the model's
    query_start_loc: torch.Tensor  # [2] int32
    seq_lens: torch.Tensor  # [1] int32
    block_tables: torch.Tensor  # [1, width] int32, every entry block 0 (read only)
    block_m: int
    num_splits: int


def attention_cases(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
    device: str | torch.device,
) -> list[AttentionCase]:  # fmt: skip
    """One case per GPU attention variant (`gpu_variants`): decodes (one query) per split
    bucket, a prompt chunk unsplit. On the meta device they give the variants' compile keys
    (tests/kernels/test_kernel_variants.py)."""
    cases = []
    for block_m, splits in gpu_variants():
        q_len = 1 if block_m == BLOCK_M_BUCKETS[0] else PROMPT_LEN
        seq_len = CONTEXT_LEN + q_len
        qkv = torch.zeros(q_len, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype,
                          device=device)  # fmt: skip
        q = split_qkv(qkv, num_heads, num_kv_heads, head_dim)[0]
        i32 = dict(dtype=torch.int32, device=device)
        cases.append(AttentionCase(
            q=q,
            query_start_loc=torch.tensor([0, q_len], **i32),  # type: ignore[arg-type]
            seq_lens=torch.tensor([seq_len], **i32),  # type: ignore[arg-type]
            block_tables=torch.zeros(1, -(-seq_len // block_size), **i32),  # type: ignore[arg-type]
            block_m=block_m, num_splits=splits,
        ))  # fmt: skip
    return cases


def warm_up(
    model: LlamaModel,
    kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    dtype: torch.dtype,
    max_model_len: int,
) -> dict[str, Any]:
    """Compile every variant; called once at start-up, before the worker is ready, with the KV
    pool's blocks all free (the forwards write block 0, the attention launches only read).
    `dtype`: the activations'. Returns what to log (seconds, attention variants); a no-op
    returning {} unless the ops are Triton's on CUDA."""
    k_cache, v_cache = kv_layers[0]
    if not isinstance(model.ops, TritonOps) or k_cache.device.type != "cuda":
        return {}
    start = time.perf_counter()
    device = k_cache.device
    for num_tokens in (min(PROMPT_LEN, max_model_len), 1):  # the last: one row, T == S == 1
        model.forward(profile_step(num_tokens, max_model_len, block_size, device)[0], kv_layers)
    cases = attention_cases(model.num_heads, model.num_kv_heads, model.args.head_dim, dtype,
                            block_size, device)  # fmt: skip
    for c in cases:
        paged_attention(
            c.q, k_cache, v_cache, c.query_start_loc, c.seq_lens, c.block_tables, model.scale,
            block_m=c.block_m, num_splits=c.num_splits,
        )  # fmt: skip
    torch.cuda.synchronize(device)
    return {"seconds": round(time.perf_counter() - start, 3), "attention_variants": len(cases)}


class CompileWatch:
    """Counts Triton compiles in this process (JIT cache misses) through Triton's post-compile
    hook; `serving()` marks the end of start-up, after which each compile is logged."""

    def __init__(self, log: Any) -> None:
        import triton

        self.log = log
        self.num_compiled = 0
        self.num_compiled_serving = 0
        self._serving = False
        triton.knobs.runtime.jit_post_compile_hook = self._on_compile

    def serving(self) -> None:
        self._serving = True

    def _on_compile(self, *, repr: str, **_: Any) -> bool:  # noqa: A002 - Triton's keyword
        self.num_compiled += 1
        if self._serving:
            self.num_compiled_serving += 1
            self.log.warning("kernel_compiled_while_serving", kernel=repr[:300],
                             num_compiled_serving=self.num_compiled_serving)  # fmt: skip
        return False


def compile_kernels(
    config: WorkerConfig,
    model: LlamaModel,
    kv_cache: KVCache,
    dtype: torch.dtype,
    max_model_len: int,
    log: Any,
) -> Optional[CompileWatch]:
    """Called once by the runner after the KV pool exists. On CUDA: every Triton variant
    compiled before the first step, and a watch that logs any compile after it; None on CPU."""
    if not config.device.startswith("cuda"):
        return None
    watch = CompileWatch(log)
    warmed = warm_up(model, kv_cache.layers, config.block_size, dtype, max_model_len)
    if warmed:
        log.info("kernels_compiled", **warmed, num_compiled=watch.num_compiled)
    watch.serving()
    return watch
