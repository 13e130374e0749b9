"""The step cost model of the simulated worker (docs/simulator.md has the formula).

    time = launch_s + per_seq_s * B + [a prompt chunk runs] * prefill_step_s + max(compute, memory)
    compute = linear FLOPs / dense_flops + attention FLOPs / attention_flops
    memory  = weight bytes / bandwidth + (KV bytes read + KV bytes written) / kv_bandwidth
              + [more than one token] * weight bytes / pack_bandwidth

where, for a step over B sequences, sequence b having `s_b` tokens cached and computing `n_b`:
    linear FLOPs    = 2 * P_layers * sum(n_b) + 2 * P_head * (sequences that sample)
    attention FLOPs = 4 * L * H * D * sum_b (n_b * s_b + n_b * (n_b + 1) / 2)   (causal)
    KV read         = kv_bytes_per_token * sum_b (s_b + n_b)   (paged attention reads the cache
                      after the new K/V are written into it)
    KV written      = kv_bytes_per_token * sum_b n_b
One decode token costs 2 FLOPs per weight it meets; a query at position p meets p + 1 keys, each
costing 2*H*D for QK^T and 2*H*D for PV per layer. The GPU profiles read the KV cache at their
memory bandwidth and leave the pack and prefill-step terms at zero: for them the formula is the
plain roofline. The CPU's profile needs all three (docs/simulator.md, "CPU terms").

Tensor parallel over N ranks (a profile from `DeviceProfile.tensor_parallel(N)`, whose rates are
N times one device's): each rank does 1/N of the work above, then the step adds, not overlapped,
    comm = (2 L + 1) * (latency + 2 (N - 1) / N * T * hidden * 2 bytes / link_bandwidth)
           + latency + (N - 1) / N * S * vocab * 2 bytes / link_bandwidth
i.e. a ring all-reduce of the [T, hidden] bf16 activations after o_proj and after down in every
layer and after the vocab-parallel embedding, and the logits gathered to rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from services.worker.held_batch import ExpandedStep
from services.worker.sim.profiles import DeviceProfile, ModelShape

ACTIVATION_BYTES = 2  # bf16 activations and logits between tensor-parallel ranks


@dataclass(frozen=True, slots=True)
class StepWork:
    """The work of one step, independent of the device that runs it."""

    num_seqs: int
    num_tokens: int
    has_chunk: bool  # some sequence computes more than one token (a prompt chunk)
    linear_flops: float
    attention_flops: float
    weight_bytes: float
    kv_bytes: float  # read + written
    # tensor parallel: bytes of one activation all-reduce ([T, hidden] bf16), how many a step
    # makes (2 per layer + the embedding's), and the bytes of the sampled rows' logits
    allreduce_bytes: float = 0.0
    num_allreduces: int = 0
    logits_bytes: float = 0.0

    @property
    def memory_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True, slots=True)
class StepCost:
    """A step's modelled time and its parts (all in seconds)."""

    compute_s: float
    memory_s: float
    overhead_s: float
    comm_s: float = 0.0  # tensor-parallel collectives (0 on one device)

    @property
    def total_s(self) -> float:
        return self.overhead_s + max(self.compute_s, self.memory_s) + self.comm_s

    @property
    def bound(self) -> str:
        """Which term decides the step: 'compute', 'memory' or 'overhead' (both zero)."""
        if self.compute_s == 0 and self.memory_s == 0:
            return "overhead"
        return "compute" if self.compute_s >= self.memory_s else "memory"


def step_work(
    model: ModelShape,
    start_positions: Sequence[int],
    num_tokens: Sequence[int],
    num_sampled: int,
) -> StepWork:
    """The FLOPs and bytes of one step: `start_positions[b]` tokens cached, `num_tokens[b]` new."""
    total_tokens = 0
    attn_pairs = 0.0  # sum over query tokens of the keys each attends to
    kv_tokens_read = 0
    has_chunk = False
    for s, n in zip(start_positions, num_tokens, strict=True):
        has_chunk |= n > 1
        total_tokens += n
        attn_pairs += n * s + n * (n + 1) / 2
        kv_tokens_read += s + n
    linear = 2.0 * model.num_layers * model.linear_params_per_layer * total_tokens
    linear += 2.0 * model.lm_head_params * num_sampled
    attention = 4.0 * model.num_layers * model.num_heads * model.head_dim * attn_pairs
    kv_bytes = float(model.kv_bytes_per_token * (kv_tokens_read + total_tokens))
    return StepWork(
        num_seqs=len(num_tokens),
        num_tokens=total_tokens,
        has_chunk=has_chunk,
        linear_flops=linear,
        attention_flops=attention,
        weight_bytes=float(model.step_weight_bytes),
        kv_bytes=kv_bytes,
        allreduce_bytes=float(total_tokens * model.hidden_size * ACTIVATION_BYTES),
        num_allreduces=2 * model.num_layers + 1,
        logits_bytes=float(num_sampled * model.vocab_size * ACTIVATION_BYTES),
    )


def plan_work(model: ModelShape, plan: ExpandedStep) -> StepWork:
    """`step_work` of a step plan (the sequences with `sample` true sample one token each)."""
    return step_work(model, plan.start_positions, plan.num_tokens, sum(plan.sample))


def _over(amount: float, rate: Optional[float]) -> float:
    return 0.0 if rate is None else amount / rate


def step_cost(device: DeviceProfile, work: StepWork) -> StepCost:
    """The modelled time of `work` on `device`; exactly 0 on the zero-cost profile."""
    compute = _over(work.linear_flops, device.dense_flops)
    compute += _over(work.attention_flops, device.attention_flops)
    memory = _over(work.weight_bytes, device.bandwidth)
    memory += _over(work.kv_bytes, device.kv_bandwidth)
    if work.num_tokens > 1:
        memory += _over(work.weight_bytes, device.pack_bandwidth)
    overhead = device.launch_s + device.per_seq_s * work.num_seqs
    if work.has_chunk:
        overhead += device.prefill_step_s
    comm = tp_comm_seconds(device, work)
    return StepCost(compute_s=compute, memory_s=memory, overhead_s=overhead, comm_s=comm)


def tp_comm_seconds(device: DeviceProfile, work: StepWork) -> float:
    """The tensor-parallel collectives of one step (module docstring); 0 for one device."""
    n = device.tensor_parallel_size
    if n == 1 or device.link_bandwidth is None:
        return 0.0
    ring = 2.0 * (n - 1) / n * work.allreduce_bytes / device.link_bandwidth
    gather = (n - 1) / n * work.logits_bytes / device.link_bandwidth
    return work.num_allreduces * (device.link_latency_s + ring) + device.link_latency_s + gather


def step_seconds(device: DeviceProfile, model: ModelShape, plan: ExpandedStep) -> float:
    """The modelled time of one plan; called by the runner once per step."""
    if device.zero_cost:  # skip the per-sequence loop: the zero-cost run measures the engine
        return 0.0
    return step_cost(device, plan_work(model, plan)).total_s
