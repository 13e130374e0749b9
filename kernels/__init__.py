"""Triton kernels for the worker, each beside a plain-torch reference of the same function.

Importable with only torch, triton, numpy and the standard library (the GPU check imports it on a
bare CUDA machine). On CPU the kernels run only under TRITON_INTERPRET=1 (tests).
The package attributes below are the functions, which shadow their modules' names here
(`kernels.rotary` is the function); `from kernels.rotary import ...` still reads the module.
"""

from kernels.paged_attention import paged_attention, paged_attention_ref
from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.rotary import rotary, rotary_ref
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from kernels.write_kv import write_kv, write_kv_ref

__all__ = [
    "paged_attention",
    "paged_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary",
    "rotary_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "write_kv",
    "write_kv_ref",
]
