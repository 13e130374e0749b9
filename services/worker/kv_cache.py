"""The paged KV cache: per layer K and V as [num_blocks, block_size, num_kv_heads, head_dim].

A tensor-parallel rank holds only its own KV heads (num_kv_heads / world size: the runner passes
this rank's ModelArgs), so a block costs it 1/N of the bytes and the same budget holds N times
as many blocks.

K/V live only here: a sequence's tokens are found through its block table, never copied out
between steps. The number of blocks follows from a byte budget, checked at start so that one
sequence of max_model_len always fits (vLLM issue #2418 is what happens otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Optional, Union

import torch

from kernels.kv_quant import CODE_DTYPES, SCALE_BYTES
from services.worker.config import WorkerConfig
from services.worker.weights import ModelArgs

FLOAT_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def storage(kv_dtype: str, head_dim: int) -> tuple[torch.dtype, int]:
    """(element dtype, elements per row) of a KV dtype name: a float row of head_dim, or 8-bit
    codes followed by their 4-byte scale (kernels/kv_quant.py)."""
    if kv_dtype in CODE_DTYPES:
        return CODE_DTYPES[kv_dtype], head_dim + SCALE_BYTES
    return FLOAT_STORAGE[kv_dtype], head_dim


def bytes_per_block(args: ModelArgs, block_size: int, kv_dtype: str) -> int:
    """K and V of every layer for one block of tokens."""
    dtype, row = storage(kv_dtype, args.head_dim)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * args.num_layers * block_size * args.num_kv_heads * row * elem


def free_memory_bytes(device: str) -> int:
    """Free memory of the device (CUDA: mem_get_info; CPU: MemAvailable of /proc/meminfo)."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError("cannot read MemAvailable from /proc/meminfo; set kv_cache_memory")


def num_blocks_for(
    args: ModelArgs, config: WorkerConfig, dtype: str, max_model_len: int, budget: int
) -> int:
    """Blocks that fit `budget` bytes (services/worker/kv_sizing.py); ValueError (with the
    numbers) when one max-length sequence would not fit."""
    per_block = bytes_per_block(args, config.block_size, dtype)
    num_blocks = budget // per_block
    needed = -(-max_model_len // config.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds {num_blocks} blocks of "
            f"{config.block_size} tokens ({per_block} bytes each), but one sequence of "
            f"max_model_len={max_model_len} needs {needed} blocks ({needed * per_block} bytes): "
            f"raise --kv-cache-memory to at least {needed * per_block} (or "
            f"--gpu-memory-utilization) or lower --max-model-len"
        )
    return int(num_blocks)


class KVCache:
    """The block pool of every layer, allocated once at start (zeros, so padding reads are
    finite)."""

    def __init__(
        self,
        args: ModelArgs,
        num_blocks: int,
        block_size: int,
        dtype: Union[str, torch.dtype],
        device: str,
    ) -> None:
        """`dtype`: the storage's name (float32, bfloat16, float16, int8, fp8_e4m3), or a
        float torch dtype."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        self.dtype_name = dtype  # attention widens to its compute dtype as it reads
        self.dtype, row = storage(dtype, args.head_dim)
        shape = (args.num_layers, 2, num_blocks, block_size, args.num_kv_heads, row)
        self._pool = torch.zeros(shape, dtype=self.dtype, device=device)
        # [(k [N, bs, Hkv, D], v [N, bs, Hkv, D])] per layer, views into one allocation
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self._pool[i, 0], self._pool[i, 1]) for i in range(args.num_layers)
        ]

    @property
    def num_bytes(self) -> int:
        """Bytes of the whole pool (K and V of every layer) on this rank."""
        return self._pool.numel() * self._pool.element_size()

    def blocks_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of `num_blocks` blocks of every layer, as `gather` returns them."""
        shape = self._pool.shape
        return (shape[0], shape[1], num_blocks, *shape[3:])

    def gather(self, block_ids: list[int], heads: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """A copy of these blocks' K and V, [L, 2, n, bs, Hkv, row] (a KV hand-over's payload:
        services/worker/kv_transfer.py), only the KV heads [start, end) when `heads` is given
        (a re-sharding read). Called between steps."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self._pool.device)
        pool = self._pool if heads is None else self._pool[:, :, :, :, heads[0] : heads[1]]
        return pool.index_select(2, index)

    def scatter(self, block_ids: list[int], data: torch.Tensor, head_start: int = 0) -> None:
        """Write `data` ([L, 2, n, bs, h, row], as `gather` made it) into these blocks, at the
        KV heads [head_start, head_start + h). Called between steps, on blocks no held sequence
        uses yet."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self._pool.device)
        heads = self._pool[:, :, :, :, head_start : head_start + data.shape[4]]  # a view
        heads.index_copy_(2, index, data.to(heads.device))

    def check_invariants(self, tables: Iterable[tuple[list[int], int]]) -> None:
        """Raise AssertionError when the pool or the use the held sequences make of it is
        inconsistent; reads only (tests call it between steps; O(blocks held)). `tables`: each
        held sequence's (block table, computed count). Every layer's K and V are views into
        the one pool; every block id is in it; a block in two tables (a shared prefix) sits at
        the same index in both and is full of computed tokens in each: a step writes K/V only
        at positions past its sequence's computed count, so a shared block is never written."""
        assert len(self.layers) == self._pool.shape[0]
        assert self._pool.shape[2:4] == (self.num_blocks, self.block_size)
        for i, (k, v) in enumerate(self.layers):
            assert k.data_ptr() == self._pool[i, 0].data_ptr(), i
            assert v.data_ptr() == self._pool[i, 1].data_ptr(), i
        seen: dict[int, tuple[int, bool]] = {}  # block -> (index in a table, full there)
        for block_ids, num_computed in tables:
            for index, block in enumerate(block_ids):
                assert 0 <= block < self.num_blocks, block
                full = (index + 1) * self.block_size <= num_computed
                other = seen.get(block)
                if other is None:
                    seen[block] = (index, full)
                    continue
                shared_ok = other[0] == index and other[1] and full
                assert shared_ok, f"block {block} in two tables: at {index} (full: {full}), {other}"
