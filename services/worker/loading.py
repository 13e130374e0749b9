"""What a rank loads at start-up before its first step: its dtype, its length limit, its model.

Called once by ModelRunner.__init__; each function reads the config and the model's files and
returns what the runner keeps, so the runner holds the state and this module holds none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from services.worker.backend import make_ops
from services.worker.config import WorkerConfig, resolve_dtype
from services.worker.dtype_probe import resolve_auto_dtype
from services.worker.gguf_weights import OverlayWeights, gguf_block_tensors
from services.worker.model import LlamaModel
from services.worker.ops_cpu import cache_base, try_load_cpu_ext
from services.worker.parallel import Group
from services.worker.quantization import make_policy
from services.worker.weights import ModelArgs, load_weights


def load_model(
    config: WorkerConfig,
    args: ModelArgs,
    folder: Path,
    gguf: Optional[Path],
    quantization: str,
    dtype: torch.dtype,
    group: Group,
    max_model_len: int,
    log: Any,
) -> LlamaModel:
    """This rank's shard of the model, its linear layers behind the quantization policy (a
    GGUF's own blocks overlay the dense weights unless quantization is "none")."""
    weights: Any = load_weights(folder, dtype, config.device)
    if quantization != "none" and gguf is not None:  # the file's own blocks
        blocks = gguf_block_tensors(gguf, args.num_heads, args.num_kv_heads)
        weights = OverlayWeights(weights, blocks)
    ops = make_ops(config, args, dtype, log)
    ext = try_load_cpu_ext(log) if quantization != "none" else None
    policy = make_policy(quantization, dtype, ext)
    log.info("worker_ops", ops=ops.name, threads=torch.get_num_threads(), rank=group.rank,
             world_size=group.world_size, quantization=quantization)  # fmt: skip
    return LlamaModel(args, weights, ops, max_model_len, config.device, group, policy)


def own_dtype(
    config: WorkerConfig, args: ModelArgs, quantization: str, rank: int, log: Any
) -> Optional[str]:
    """The dtype this rank would pick; only rank 0's counts (agree_dtype), so only rank 0
    runs the `auto` probe."""
    if rank != 0:
        return None
    if quantization != "none" and resolve_dtype(config) is None:
        # the block and int8 kernels multiply in fp32 whatever the activations' dtype
        log.info("dtype_auto", dtype="float32", source="quantization", quantization=quantization)
        return "float32"
    return resolve_dtype(config) or resolve_auto_dtype(args, cache_base() / "dtype", log)


def max_model_len(config: WorkerConfig, args: ModelArgs) -> int:
    """The longest sequence served: the config's limit, never past the model's positions."""
    limit = args.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's "
            f"max_position_embeddings={limit}: lower --max-model-len"
        )
    return config.max_model_len
