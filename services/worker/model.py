"""The Llama-family forward pass over one flattened, mixed step.

RMSNorm, rotary embeddings (rotate-half layout), grouped-query attention against the paged KV
cache, SwiGLU MLP, tied or untied LM head, optional Qwen2-style q/k/v bias. Each linear layer
runs once per step over all the step's tokens (q/k/v and gate/up are fused into one matrix each);
logits are computed only at the rows that sample. Small kernels go through an ops object
(TorchOps or TritonOps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from services.worker.weights import ModelArgs, take, take_optional


@dataclass(frozen=True, slots=True)
class StepTensors:
    """One step, flattened over all scheduled sequences (built by InputBatch)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [S] int64, flat rows whose logits are sampled


@dataclass(frozen=True, slots=True)
class _Layer:
    input_norm: torch.Tensor  # [Hd]
    qkv: torch.Tensor  # [(H + 2 Hkv) D, Hd]
    qkv_bias: Optional[torch.Tensor]  # [(H + 2 Hkv) D]
    o_proj: torch.Tensor  # [Hd, H D]
    post_norm: torch.Tensor  # [Hd]
    gate_up: torch.Tensor  # [2 I, Hd]
    down: torch.Tensor  # [Hd, I]


def rotary_cache(args: ModelArgs, max_len: int, device: str) -> torch.Tensor:
    """[max_len, D] float32 rows [cos(D/2) | sin(D/2)], as HF Llama computes them."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.int64).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


class LlamaModel:
    """Weights plus the forward pass; holds no per-request state."""

    def __init__(
        self, args: ModelArgs, weights: dict[str, torch.Tensor], ops: Any, max_len: int, device: str
    ) -> None:
        self.args = args
        self.ops = ops
        self.embed = take(weights, "model.embed_tokens.weight")  # [V, Hd]
        self.norm = take(weights, "model.norm.weight")
        head = take_optional(weights, "lm_head.weight")
        if head is None and not args.tie_word_embeddings:
            raise ValueError("model weights lack 'lm_head.weight' and embeddings are not tied")
        self.lm_head = self.embed if args.tie_word_embeddings or head is None else head
        self.layers = [self._layer(weights, i) for i in range(args.num_layers)]
        self.cos_sin = rotary_cache(args, max_len, device)
        self.scale = args.head_dim**-0.5

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> _Layer:
        p = f"model.layers.{i}."
        qkv = [take(w, f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
        biases = [take_optional(w, f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None  # type: ignore
        gate_up = [take(w, f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
        return _Layer(
            input_norm=take(w, f"{p}input_layernorm.weight"),
            qkv=torch.cat(qkv).contiguous(),
            qkv_bias=bias,
            o_proj=take(w, f"{p}self_attn.o_proj.weight"),
            post_norm=take(w, f"{p}post_attention_layernorm.weight"),
            gate_up=torch.cat(gate_up).contiguous(),
            down=take(w, f"{p}mlp.down_proj.weight"),
        )

    @torch.inference_mode()
    def forward(
        self, step: StepTensors, kv_layers: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Run every layer over the step's T tokens, writing their K/V into the cache;
        return logits [S, V] at `step.logits_indices`, in the model's dtype (the sampler
        casts only when it needs to)."""
        a, ops = self.args, self.ops
        t = step.input_ids.shape[0]
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        x = self.embed[step.input_ids]  # [T, Hd]
        residual: Optional[torch.Tensor] = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_layers, strict=True):
            h, residual = ops.rms_norm(x, layer.input_norm, a.rms_norm_eps, residual)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # [T, (H + 2 Hkv) D]
            q = qkv[:, :q_size].view(t, a.num_heads, a.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(t, a.num_kv_heads, a.head_dim)
            v = qkv[:, q_size + kv_size :].view(t, a.num_kv_heads, a.head_dim)
            ops.rotary(q, k, step.positions, self.cos_sin)
            ops.write_kv(k, v, k_cache, v_cache, step.slot_mapping)
            attn = ops.paged_attention(
                q,
                k_cache,
                v_cache,
                step.query_start_loc,
                step.seq_lens,
                step.block_tables,
                self.scale,
            )
            x = F.linear(attn.reshape(t, q_size), layer.o_proj)
            h, residual = ops.rms_norm(x, layer.post_norm, a.rms_norm_eps, residual)
            x = F.linear(ops.silu_and_mul(F.linear(h, layer.gate_up)), layer.down)
        rows = step.logits_indices
        # only the sampled rows need the final norm and the LM head
        h, _ = ops.rms_norm(x[rows], self.norm, a.rms_norm_eps, residual[rows])  # type: ignore
        return F.linear(h, self.lm_head)
