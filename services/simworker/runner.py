"""SimRunner: a worker that holds no model (SIMULATED).

It answers every step plan after the time the cost model gives for that step on the configured
device and model, with deterministic tokens. It keeps the same per-request state a real worker
keeps (block table length, tokens in the KV cache) only to check the plans it receives, so it
doubles as a checker of the scheduler's side of the step contract.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import structlog

from services.simworker.config import DEFAULT_TOKEN_ID_HIGH, SimConfig
from services.simworker.cost_model import step_seconds
from services.simworker.overhead import GapRecorder
from services.simworker.profiles import DeviceProfile, ModelShape
from services.simworker.tokens import TokenSource, request_seed
from shared.protocol.worker_channel import (
    NewSequence,
    StepPlan,
    StepResult,
    TokenLogprobs,
    WorkerReady,
    check_plan,
)

SPIN_S = 2e-4  # sleep until this close to the deadline, then spin: sleep() overshoots ~50-100 us
ACTIVATION_RESERVE = 0.05  # share of usable memory kept for activations and workspace
SIM_LOGPROB_OTHERS = -100.0  # the simulated distribution is a point mass on the chosen token


@dataclass(slots=True)
class _SimSeq:
    seed: int
    num_prompt_tokens: int
    num_cached: Optional[int]  # tokens the (imaginary) KV cache holds; None: not yet scheduled
    num_blocks: int  # length of the block table
    forbidden: frozenset[int]
    allow_eos: bool
    logprobs: Optional[int]


def kv_capacity_blocks(device: DeviceProfile, model: ModelShape, block_size: int) -> int:
    """KV blocks that fit in the device's usable memory after the weights and a reserve."""
    usable = device.memory_bytes * device.memory_utilization * (1.0 - ACTIVATION_RESERVE)
    free = usable - model.weight_bytes
    if free <= 0:
        raise ValueError(
            f"SIMULATED: {model.name} weights ({model.weight_bytes / 1e9:.1f} GB) do not fit in "
            f"{device.name}'s usable memory ({usable / 1e9:.1f} GB)"
        )
    return int(free // (block_size * model.kv_bytes_per_token))


class SimRunner:
    """The simulated worker's runner: `ready_message(rank)` once, then `execute(plan)` per step."""

    def __init__(self, config: SimConfig, log: Any = None, world_size: int = 1) -> None:
        self.config = config
        self.world_size = world_size  # processes of its group (each models the whole step)
        self.device = config.device_profile()
        self.model = config.model_shape()
        self._log = (log if log is not None else structlog.get_logger()).bind(simulated=True)
        fit = kv_capacity_blocks(self.device, self.model, config.block_size)
        self.num_blocks = config.num_blocks if config.num_blocks is not None else fit
        capacity = self.num_blocks * config.block_size
        # Unset: the model's limit, capped by the pool; a limit asked for must fit whole.
        max_len = config.max_model_len or min(self.model.max_position, capacity)
        if capacity < max_len:
            raise ValueError(
                f"SIMULATED: max_model_len {max_len} exceeds the KV capacity of "
                f"{self.num_blocks} blocks x {config.block_size} tokens"
            )
        self.max_model_len = max_len
        high = config.token_id_high or min(self.model.vocab_size, DEFAULT_TOKEN_ID_HIGH)
        self._tokens = TokenSource(
            config.token_id_low, high, tuple(self.model.eos_token_ids), config.eos_probability
        )
        self._seqs: dict[str, _SimSeq] = {}
        self._gaps = GapRecorder(config.report_every, self._log)
        self._log.info(
            "sim_worker_start",
            note="SIMULATED worker: no model runs; step times come from a cost model",
            device=self.device.name,
            model=self.model.name,
            num_blocks=self.num_blocks,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            source=self.device.source,
        )

    def ready_message(self, rank: int = 0) -> WorkerReady:
        """Called once by the worker loop before the first plan."""
        return WorkerReady(
            rank=rank,
            num_blocks=self.num_blocks,
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            model_name=f"sim:{self.model.name}",
            vocab_size=self.model.vocab_size,
            eos_token_ids=list(self.model.eos_token_ids),
            dtype=self.config.weight_dtype,
            device=f"sim:{self.device.name}",
            world_size=self.world_size,
        )

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan: check it, wait the modelled step time, return the sampled tokens.

        Raises ValueError when the plan breaks the step contract (the worker loop reports it).
        """
        start = time.perf_counter()
        pure_decode = plan.total_tokens == plan.num_seqs  # every chunk holds >= 1 token
        self._gaps.step_started(start, plan.num_seqs, pure_decode)
        check_plan(plan)
        for rid in plan.released_rids:
            self._seqs.pop(rid, None)
        for seq in plan.new_seqs:
            self._seqs[seq.rid] = self._new_state(seq)
        rids, token_ids, logprobs = self._advance(plan)
        _wait_until(start + step_seconds(self.device, self.model, plan))
        end = time.perf_counter()
        self._gaps.step_finished(end)
        return StepResult(plan.step_id, rids, token_ids, logprobs, forward_s=end - start)

    def _new_state(self, seq: NewSequence) -> _SimSeq:
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        s = seq.sampling
        return _SimSeq(
            seed=request_seed(seq.rid, prompt, s),
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached=None,  # the first plan that schedules it says (a cached prefix may skip)
            num_blocks=len(seq.block_ids),
            forbidden=self._tokens.forbidden_ids(s),
            allow_eos=not s.ignore_eos and self.config.eos_probability > 0.0,
            logprobs=s.logprobs,
        )

    def _advance(self, plan: StepPlan) -> tuple[list[str], list[int], dict[str, TokenLogprobs]]:
        """Check each scheduled sequence against its state, advance it, sample where asked.

        The hot loop of a zero-cost run (one pass per sequence per step): columns are zipped
        and the common case (a decode, no new block) touches no extra branch.
        """
        rids: list[str] = []
        token_ids: list[int] = []
        logprobs: dict[str, TokenLogprobs] = {}
        seqs, token = self._seqs, self._tokens.token
        bs, max_len, num_blocks = self.config.block_size, self.max_model_len, self.num_blocks
        columns = (plan.rids, plan.start_positions, plan.num_tokens, plan.new_block_ids,
                   plan.sample)  # fmt: skip
        for rid, start, n, new_blocks, sample in zip(*columns, strict=True):
            st = seqs.get(rid)
            if st is None:
                raise ValueError(f"plan {plan.step_id} schedules unknown request {rid!r}")
            if start != st.num_cached and st.num_cached is not None:
                raise ValueError(
                    f"plan {plan.step_id}: {rid!r} starts at {start}, cache holds {st.num_cached}"
                )
            if new_blocks:
                if min(new_blocks) < 0 or max(new_blocks) >= num_blocks:
                    raise ValueError(f"plan {plan.step_id}: {rid!r} gets a block id out of range")
                st.num_blocks += len(new_blocks)
            end = st.num_cached = start + n
            if end > st.num_blocks * bs or end > max_len:
                raise ValueError(
                    f"plan {plan.step_id}: {rid!r} computes past its block table or max_model_len"
                )
            if sample:
                tok = token(st.seed, end - st.num_prompt_tokens, st.forbidden, st.allow_eos)
                rids.append(rid)
                token_ids.append(tok)
                if st.logprobs is not None:
                    logprobs[rid] = self._logprobs(st, tok)
        return rids, token_ids, logprobs

    def _logprobs(self, st: _SimSeq, tok: int) -> TokenLogprobs:
        """A point-mass distribution: the chosen token first (0.0), then the next ids (-100)."""
        k = st.logprobs or 0
        low, span = self._tokens.low, self._tokens.high - self._tokens.low
        top = [tok] + [low + (tok - low + j) % span for j in range(1, k)]
        top_logprobs = [0.0] + [SIM_LOGPROB_OTHERS] * (k - 1)
        return TokenLogprobs(0.0, top[:k], top_logprobs[:k])


def _wait_until(deadline: float) -> None:
    """Return at `deadline` (perf_counter seconds) to within a few microseconds."""
    remaining = deadline - time.perf_counter()
    if remaining > SPIN_S:
        time.sleep(remaining - SPIN_S)
    while time.perf_counter() < deadline:
        pass
