"""The Llama-family forward pass over one flattened, mixed step.

RMSNorm, rotary embeddings (rotate-half layout), grouped-query attention against the paged KV
cache, SwiGLU MLP, tied or untied LM head, optional Qwen2-style q/k/v bias. Each linear layer
runs once per step over all the step's tokens (q/k/v and gate/up are fused into one matrix each);
logits are computed only at the rows that sample. Small kernels go through an ops object
(TorchOps, CpuOps or TritonOps).

Tensor parallel (services/worker/sharding.py, parallel.py): each rank keeps its query and KV
heads, its slice of the MLP and of the vocabulary; o_proj and down are followed by an all-reduce,
the embedding by one, and the logits are gathered to rank 0. Attention sees only local heads, so
the kernels are unchanged. With one rank every collective is a no-op.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from services.worker.linear import DenseWeights, Linear, WeightsPolicy, held_bytes
from services.worker.parallel import Group, SingleRank
from services.worker.sharding import Shard, fused_rows
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
    # H, Hkv, I: this rank's query heads, KV heads and intermediate features (all / world size)
    input_norm: torch.Tensor  # [Hd]
    qkv: Linear  # Hd -> (H + 2 Hkv) D, with the q/k/v bias if the model has one
    o_proj: Linear  # H D -> Hd
    post_norm: torch.Tensor  # [Hd]
    gate_up: Linear  # Hd -> 2 I
    down: Linear  # I -> Hd
    native: Optional[Any]  # the layer as one kernel call (ops.native_layer), or None


def rotary_cache(args: ModelArgs, max_len: int, device: str) -> torch.Tensor:
    """[max_len, D] float32 rows [cos(D/2) | sin(D/2)], as HF Llama computes them."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.int64).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, (H + 2 Hkv) D] -> views q [T, H, D], k and v [T, Hkv, D]: the strides the kernels
    see (and compile for: services/worker/warmup.py builds its inputs the same way)."""
    t, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(t, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(t, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(t, num_kv_heads, head_dim)
    return q, k, v


class LlamaModel:
    """Weights (this rank's shard) plus the forward pass; holds no per-request state."""

    def __init__(
        self,
        args: ModelArgs,
        weights: Mapping[str, torch.Tensor],
        ops: Any,
        max_len: int,
        device: str,
        group: Optional[Group] = None,
        policy: Optional[WeightsPolicy] = None,
    ) -> None:
        """`group`: the tensor-parallel group (None: one rank). Its world size must divide the
        head counts and the intermediate size (parallel.check_divides, checked before).
        `policy`: what each weight becomes (services/worker/linear.py; None: dense tensors as
        read)."""
        self.args = args
        self.ops = ops
        self.policy: WeightsPolicy = policy or DenseWeights(None)
        self.group: Group = group if group is not None else SingleRank()
        self.shard = Shard(self.group.rank, self.group.world_size)
        n = self.shard.world_size
        self.num_heads, self.num_kv_heads = args.num_heads // n, args.num_kv_heads // n
        self.vocab_start, vocab_end = self.shard.vocab_span(args.vocab_size)
        self.vocab_local = vocab_end - self.vocab_start
        embed = take(weights, "model.embed_tokens.weight")  # [V, Hd]
        self.embed = self.policy.embedding(self.shard.vocab_rows(embed))  # [V_local] -> Hd
        self.norm = take(weights, "model.norm.weight")
        head = take_optional(weights, "lm_head.weight")
        if head is None and not args.tie_word_embeddings:
            raise ValueError("model weights lack 'lm_head.weight' and embeddings are not tied")
        tied = args.tie_word_embeddings or head is None
        self.lm_head: Linear = (  # Hd -> V_local
            self.policy.lm_head(self.embed)
            if tied
            else self.policy.linear(self.shard.vocab_rows(head))  # type: ignore[arg-type]
        )
        del embed, head
        self.layers = [self._layer(weights, i) for i in range(args.num_layers)]
        # every layer one kernel call per step (when the KV cache is a float one: hidden_states)
        self.native = False
        self.use_native_layers(True)
        self.cos_sin = rotary_cache(args, max_len, device)
        self.scale = args.head_dim**-0.5

    def _layer(self, w: Mapping[str, torch.Tensor], i: int) -> _Layer:
        p, sh = f"model.layers.{i}.", self.shard
        qkv = [take(w, f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
        biases = [take_optional(w, f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
        has_bias = all(b is not None for b in biases)
        gate_up = [take(w, f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
        policy = self.policy
        bias = fused_rows(sh, biases) if has_bias else None  # type: ignore[arg-type]
        input_norm = policy.vector(take(w, f"{p}input_layernorm.weight"))
        post_norm = policy.vector(take(w, f"{p}post_attention_layernorm.weight"))
        linears = (
            policy.linear(fused_rows(sh, qkv), bias),
            policy.linear(sh.cols(take(w, f"{p}self_attn.o_proj.weight"))),
            policy.linear(fused_rows(sh, gate_up)),
            policy.linear(sh.cols(take(w, f"{p}mlp.down_proj.weight"))),
        )
        # one rank only: a whole-layer kernel has no all-reduce inside
        native = (
            self.ops.native_layer(input_norm, post_norm, linears) if sh.world_size == 1 else None
        )
        return _Layer(input_norm, *linears[:2], post_norm, *linears[2:], native)  # type: ignore[misc]

    def use_native_layers(self, on: bool) -> None:
        """Whether layers that have a whole-layer kernel run it (`on`, the default where every
        layer has one) or their Python sequence of ops calls (tests and benches compare the two)."""
        self.native = on and all(layer.native is not None for layer in self.layers)

    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds, as held (packed blocks with their scales; a
        tied LM head that shares the embedding's tensor counted once)."""
        parts: list[Any] = [self.embed, self.lm_head]
        for layer in self.layers:
            parts += [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
        norms = [self.norm] + [t for ly in self.layers for t in (ly.input_norm, ly.post_norm)]
        return held_bytes(parts) + sum(t.numel() * t.element_size() for t in norms)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, Hd]; vocab-parallel: each rank looks up the ids it owns (zeros for
        the others) and one all-reduce sums the shares."""
        if self.shard.world_size == 1:
            return self.embed(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        x = self.embed(local.masked_fill(outside, 0))
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(x)

    @torch.inference_mode()
    def forward(
        self, step: StepTensors, kv_layers: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Optional[torch.Tensor]:
        """Run every layer over the step's T tokens, writing their K/V (local heads) into the
        cache; return logits [S, V] at `step.logits_indices`, in the model's dtype (the sampler
        casts only when it needs to). Tensor parallel: rank 0 gets the gathered logits, the
        other ranks None. Every rank must call it with the same step (collectives inside)."""
        x, residual = self.hidden_states(step, kv_layers)
        return self.logits(x, residual, step.logits_indices)

    @torch.inference_mode()
    def hidden_states(
        self, step: StepTensors, kv_layers: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` up to the final norm: the last layer's output and residual, [T, Hd] each,
        the same on every rank (embedding requests pool them: `final_norm`)."""
        x = self._embed(step.input_ids)  # [T, Hd]
        residual: Optional[torch.Tensor] = None
        # the whole-layer kernel writes float caches only (8-bit rows: the ops' own write)
        native = self.native and kv_layers[0][0].is_floating_point()
        eps = self.args.rms_norm_eps
        for layer, (k_cache, v_cache) in zip(self.layers, kv_layers, strict=True):
            if native:
                x, residual = self.ops.decoder_layer(
                    layer.native, x, residual, eps, step, self.cos_sin, k_cache, v_cache, self.scale
                )
            else:
                x, residual = self._layer_forward(layer, x, residual, step, k_cache, v_cache)
        return x, residual  # type: ignore[return-value]

    def _layer_forward(
        self,
        layer: _Layer,
        x: torch.Tensor,  # [T, Hd]
        residual: Optional[torch.Tensor],  # [T, Hd], None before the first layer
        step: StepTensors,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer as a sequence of ops calls: (output, residual), [T, Hd] each."""
        a, ops, group = self.args, self.ops, self.group
        t = step.input_ids.shape[0]
        q_size = self.num_heads * a.head_dim
        h, residual = ops.rms_norm(x, layer.input_norm, a.rms_norm_eps, residual)
        # rotary on q and k in place, k and v into the cache; q [T, H, D] a view of qkv
        q = ops.rotary_write_kv(
            layer.qkv(h), step.positions, self.cos_sin, k_cache, v_cache, step.slot_mapping
        )
        attn = ops.paged_attention(
            q,
            k_cache,
            v_cache,
            step.query_start_loc,
            step.seq_lens,
            step.block_tables,
            self.scale,
        )
        x = group.all_reduce(layer.o_proj(attn.reshape(t, q_size)))  # [T, Hd]
        h, residual = ops.rms_norm(x, layer.post_norm, a.rms_norm_eps, residual)
        x = layer.down(ops.silu_and_mul(layer.gate_up(h)))
        x = group.all_reduce(x)  # [T, Hd]
        return x, residual  # type: ignore[return-value]

    def final_norm(
        self, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """The final hidden states [R, Hd] at flat `rows` (the norm of the last residual sum)."""
        h, _ = self.ops.rms_norm(x[rows], self.norm, self.args.rms_norm_eps, residual[rows])
        return h

    def logits(
        self, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """Logits [S, V] at `rows` (only the sampled rows need the final norm and the LM head);
        gathered to rank 0, None on the other ranks."""
        logits = self.group.gather_to_first(self.lm_head(self.final_norm(x, residual, rows)))
        return None if logits is None else logits[:, : self.args.vocab_size]
