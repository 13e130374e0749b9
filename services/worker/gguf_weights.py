"""Native GGUF weights: a converted model's quantized tensors read back from its source file.

The converted folder (shared/model_files.py) holds every tensor dequantized to fp32; under
`--quantization auto` the worker serves the file's own blocks instead. This module reads them as
`kernels.quant.QuantWeight` by their Hugging Face names, with llama.cpp's rotary row order of Q
and K undone exactly as the converter does (rows move; blocks run along K, so they stay whole).
Q4_0, Q4_1 and Q8_0 are kept as they are. Any other block format (the K-quants, Q5_x, ...) is
dequantized by the gguf package and requantized to Q8_0: 8.5 bits per weight, the closest
format the kernel reads (documented in docs/PERFORMANCE.md). F32/F16/BF16 tensors and 1-D
tensors stay with the folder's dense copy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Union

import numpy as np
import torch

from kernels.quant import QuantWeight, from_gguf_blocks, quantize
from shared.model_files import hf_tensor_name, unpermute_rotary

NATIVE_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}
DENSE_TYPES = ("F32", "F16", "BF16", "F64")
REQUANT_FORMAT = "q8_0"  # what other block formats load as

Weight = Union[torch.Tensor, QuantWeight]


def gguf_block_tensors(
    gguf_path: Path, num_heads: int, num_kv_heads: int
) -> dict[str, QuantWeight]:
    """HF name -> QuantWeight for every 2-D tensor of the file stored in a block format."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    out: dict[str, QuantWeight] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in DENSE_TYPES or len(t.shape) != 2:
            continue
        name = hf_tensor_name(t.name)
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists dims innermost first
        raw = np.asarray(t.data).reshape(shape[0], -1)
        heads = _rotary_heads(name, num_heads, num_kv_heads)
        if kind in NATIVE_TYPES:
            if heads:
                raw = unpermute_rotary(raw, heads)
            out[name] = from_gguf_blocks(NATIVE_TYPES[kind], raw, shape)
            continue
        from gguf.quants import dequantize

        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if heads:
            w = unpermute_rotary(w.reshape(shape), heads)
        out[name] = quantize(torch.from_numpy(w.reshape(shape)), REQUANT_FORMAT)
    return out


def _rotary_heads(name: str, num_heads: int, num_kv_heads: int) -> int:
    if name.endswith("q_proj.weight"):
        return num_heads
    if name.endswith("k_proj.weight"):
        return num_kv_heads
    return 0


class OverlayWeights(Mapping[str, Weight]):
    """The folder's dense tensors, with `blocks` (quantized) answering for their names first."""

    def __init__(self, dense: Mapping[str, torch.Tensor], blocks: Mapping[str, QuantWeight]):
        self._dense = dense
        self._blocks = blocks

    def __getitem__(self, name: str) -> Weight:
        block = self._blocks.get(name)
        return block if block is not None else self._dense[name]

    def __iter__(self) -> Iterator[str]:
        return iter(set(self._dense) | set(self._blocks))

    def __len__(self) -> int:
        return len(set(self._dense) | set(self._blocks))
