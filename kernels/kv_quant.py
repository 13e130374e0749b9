"""8-bit KV cache rows: each token's key (or value) of each KV head as head_dim codes followed by
its own fp32 scale (4 bytes), like a GGUF Q8_0 block whose scale travels with its codes.

`int8`: code = round(x / s), s = absmax / 127. `fp8_e4m3`: code = e4m3(x / s), s = absmax / 448
(the codes are the float8_e4m3fn bytes, stored as uint8). The scale is written by the same
store that writes the codes (the KV-write path: TorchOps.write_kv, the Triton write_kv), so a
row is never half-updated, and every reader (the torch path, the C++ and Triton attention)
widens code * scale to fp32. A row costs head_dim + 4 bytes: 68 for SmolLM2's 64, against 256
in fp32 and 128 in bf16.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
CODE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.uint8}  # storage of the 8-bit kinds
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
_FP8_TABLES: dict[torch.device, torch.Tensor] = {}


def fp8_e4m3_table(device: torch.device) -> torch.Tensor:
    """[256] float32: the value of every e4m3 byte (a reader's lookup table), one per device."""
    table = _FP8_TABLES.get(device)
    if table is None:
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
        table = _FP8_TABLES[device] = codes.float().nan_to_num(0.0).to(device)
    return table


def scaled_kind(cache: torch.Tensor) -> str:
    """ "int8" or "fp8_e4m3" for an 8-bit cache (by its storage dtype), "" for a float one."""
    return {torch.int8: "int8", torch.uint8: "fp8_e4m3"}.get(cache.dtype, "")


def quantize_rows(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., D] float -> [..., D + 4] codes and scale, in the kind's storage dtype."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / _QMAX[kind]
    y = xf / scale
    if kind == "int8":
        codes = y.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    scale_bytes = scale.contiguous().view(torch.uint8)  # [..., 4]
    return torch.cat([codes, scale_bytes], dim=-1).view(CODE_DTYPES[kind])


def dequantize_rows(rows: torch.Tensor, kind: str) -> torch.Tensor:
    """[..., D + 4] codes and scale -> [..., D] float32."""
    raw = rows.view(torch.uint8)
    d = raw.shape[-1] - SCALE_BYTES
    scale = raw[..., d:].contiguous().view(torch.float32)  # [..., 1]
    codes = raw[..., :d]
    if kind == "int8":
        values = codes.view(torch.int8).float()
    else:
        values = codes.contiguous().view(torch.float8_e4m3fn).float()
    return values * scale
