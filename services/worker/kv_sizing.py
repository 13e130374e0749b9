"""The KV pool's byte budget, decided once the weights are loaded (called by the runner).

`--kv-cache-memory` gives it outright (default 1 GiB). `--gpu-memory-utilization` (vLLM's
meaning) gives the share of the device this worker may use in all. On CUDA the budget is that
share of the GPU's total memory, less the peak torch allocated during a profiling forward of
`profile_num_tokens` tokens (weights + activations at the largest step; its scratch KV blocks
taken back out) and less the memory outside torch's allocator (CUDA context, library
workspaces). On CPU nothing can be measured that way (the allocator hands memory back, several
processes share the host): the budget is that share of the memory available once the weights
are loaded. Every number behind the budget is logged (`kv_cache_sized`).
"""

from __future__ import annotations

from typing import Any

import torch

from services.worker.config import DEFAULT_KV_CACHE_MEMORY, WorkerConfig
from services.worker.kv_cache import KVCache, free_memory_bytes
from services.worker.model import LlamaModel, StepTensors
from services.worker.weights import ModelArgs

PROFILE_LOGITS_ROWS = 256  # LM-head rows of the profiling forward (a large batch sampling)


def kv_budget_bytes(
    config: WorkerConfig, model: LlamaModel, kv_args: ModelArgs, kv_dtype: str,
    max_model_len: int, log: Any,
) -> int:  # fmt: skip
    """Bytes for this rank's KV pool; ValueError when the utilization leaves none. `kv_args`:
    this rank's share of the heads (the pool's shape)."""
    util = config.gpu_memory_utilization
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if util is None:
        return DEFAULT_KV_CACHE_MEMORY
    if config.device.startswith("cuda"):
        facts = _cuda_facts(config, model, kv_args, kv_dtype, max_model_len)
        budget = int(util * facts["total"]) - facts["peak_torch"] - facts["outside_torch"]
    else:
        facts = {"available_after_weights": free_memory_bytes(config.device)}
        budget = int(util * facts["available_after_weights"])
    log.info("kv_cache_sized", gpu_memory_utilization=util, budget=budget,
             weights=model.weight_bytes(), **facts)  # fmt: skip
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={util} leaves no memory for the KV cache ({facts}): "
            "raise it or lower --profile-num-tokens"
        )
    return budget


def _cuda_facts(
    config: WorkerConfig, model: LlamaModel, kv_args: ModelArgs, kv_dtype: str,
    max_model_len: int,
) -> dict[str, int]:  # fmt: skip
    # One forward of profile_num_tokens prompt tokens (sequences of at most max_model_len) into
    # a scratch pool just large enough, measuring torch's peak.
    device = torch.device(config.device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    step, num_blocks = profile_step(config.profile_num_tokens, max_model_len, config.block_size,
                                    device)  # fmt: skip
    scratch = KVCache(kv_args, num_blocks, config.block_size, kv_dtype, config.device)
    model.forward(step, scratch.layers)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch.num_bytes
    del scratch, step
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside = max(0, total - free - torch.cuda.memory_reserved(device))
    return {"total": int(total), "peak_torch": int(peak), "outside_torch": int(outside),
            "profile_num_tokens": config.profile_num_tokens}  # fmt: skip


def profile_step(
    num_tokens: int, max_model_len: int, block_size: int, device: torch.device
) -> tuple[StepTensors, int]:
    """A step of `num_tokens` prompt tokens as sequences of at most max_model_len tokens, each
    in blocks of its own, sampling PROFILE_LOGITS_ROWS rows; and the blocks it uses."""
    lens = [max_model_len] * (num_tokens // max_model_len)
    lens += [num_tokens % max_model_len] if num_tokens % max_model_len else []
    widths = [-(-n // block_size) for n in lens]
    table = torch.zeros(len(lens), max(widths), dtype=torch.int32)
    slots, first = [], 0
    for b, (n, w) in enumerate(zip(lens, widths, strict=True)):
        table[b, :w] = torch.arange(first, first + w, dtype=torch.int32)
        slots.append(torch.arange(n) + first * block_size)
        first += w
    starts = torch.tensor([0, *lens]).cumsum(0)
    rows = min(num_tokens, PROFILE_LOGITS_ROWS)
    to = dict(device=device)
    return StepTensors(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, **to),  # type: ignore[arg-type]
        positions=torch.cat([torch.arange(n) for n in lens]).to(device),
        query_start_loc=starts.to(torch.int32).to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, **to),  # type: ignore[arg-type]
        block_tables=table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        logits_indices=torch.linspace(0, num_tokens - 1, rows).long().to(device),
    ), first
