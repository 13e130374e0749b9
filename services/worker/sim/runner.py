"""SimRunner: the worker with a cost model where ModelRunner runs the forward (SIMULATED).

It is a StepRunner of the one worker loop (services/worker/loop.py, steps.py) and moves the
one held batch (services/worker/held_batch.py: token histories, block tables, computed counts)
by each plan, as ModelRunner does; only its "model" differs: it answers every step after the
time the cost model gives for that step on the configured device and model, with deterministic
tokens. So it checks the plans it receives exactly as the real worker does: it doubles as a
checker of the scheduler's side of the step contract.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import structlog

from services.worker.held_batch import ExpandedStep, HeldBatch, HeldSeq
from services.worker.sim.config import DEFAULT_TOKEN_ID_HIGH, SimConfig
from services.worker.sim.cost_model import step_seconds
from services.worker.sim.overhead import GapRecorder
from services.worker.sim.profiles import DeviceProfile, ModelShape
from services.worker.sim.tokens import TokenSource, mix64, request_seed
from shared.protocol.worker_channel import (
    DraftOutcome,
    StepPlan,
    StepResult,
    TokenLogprobs,
    WorkerReady,
)

SPIN_S = 2e-4  # sleep until this close to the deadline, then spin: sleep() overshoots ~50-100 us
ACTIVATION_RESERVE = 0.05  # share of usable memory kept for activations and workspace
SIM_LOGPROB_OTHERS = -100.0  # the simulated distribution is a point mass on the chosen token


@dataclass(slots=True)
class _SimSeq:
    seed: int
    num_prompt_tokens: int
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

    def __init__(
        self,
        config: SimConfig,
        log: Any = None,
        world_size: int = 1,
        wait: Optional[Callable[[float], None]] = None,
    ) -> None:
        """`wait`: how a step waits for its modelled end (a perf_counter deadline) before the
        last spin; None: sleeps (sim/kv_link.py `kv_during_steps`: pulls land, reads answered)."""
        self.config = config
        self._wait = wait
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
        # the persistent batch (checks every plan) and, per slot, how its sequence samples
        self._batch = HeldBatch(self.num_blocks, config.block_size, self.max_model_len)
        self._seqs: dict[int, _SimSeq] = {}
        # the same per slot as arrays, for drawing a whole step's tokens at once
        self._slot_seeds = np.zeros(0, dtype=np.uint64)
        self._slot_prompt_lens = np.zeros(0, dtype=np.int64)
        self._forbidden = np.zeros(0, dtype=np.int64)  # every id forbidden to any sequence
        self._logprob_slots: set[int] = set()  # slots whose sequence asked for logprobs
        self._gaps = GapRecorder(config.report_every, self._log)
        self._noise = np.random.default_rng(0)  # seeded: a run's noise is reproducible
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
            proposer=None if self.config.spec_acceptance is None else "sim",
        )

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan: apply it to the held batch (which checks it), wait the modelled step
        time, return the sampled tokens.

        Raises ValueError when the plan breaks the step contract (the worker loop reports it);
        the batch then accepts only a reset plan.
        """
        start = time.perf_counter()
        pure_decode = not plan.counts and not plan.new_seqs
        self._gaps.step_started(start, plan.num_scheduled_tokens, pure_decode)
        step = self._batch.apply(plan)  # a plan that does not fit raises, and needs a reset
        for seq in step.new_seqs:
            self._add_state(seq)
        drafts = self._speculate(step) if step.draft_limits else None
        token_ids, logprobs = self._sample(step)
        seconds = step_seconds(self.device, self.model, step)
        if self.config.step_noise:
            seconds *= float(self._noise.lognormal(0.0, self.config.step_noise))
        if self._wait is not None:
            self._wait(start + seconds)
        _wait_until(start + seconds)
        end = time.perf_counter()
        self._gaps.step_finished(end)
        return StepResult(plan.step_id, token_ids, logprobs, forward_s=end - start, drafts=drafts)

    def _speculate(self, step: ExpandedStep) -> Optional[DraftOutcome]:
        """Every draft the plan allows, each right with the configured chance: they join the
        step (the cost model counts them) and the accepted ones stay in the history, so the
        sample that follows is the token at the index after them (`_sample`)."""
        rate = self.config.spec_acceptance
        if rate is None or not step.draft_limits:
            return None
        outcome = DraftOutcome(logprobs=[] if self._logprob_slots else None)
        rows = {b: i for i, b in enumerate(b for b, s in enumerate(step.sample) if s)}
        for b, limit in step.draft_limits.items():
            seq, st = step.seqs[b], self._seqs[step.seqs[b].slot]
            n = len(seq.token_ids) - st.num_prompt_tokens
            drafts, accepted = [], None
            for j in range(limit):
                right = self._tokens.token(st.seed, n + j, st.forbidden, st.allow_eos)
                hit = (mix64(st.seed ^ mix64(n + j + 1)) >> 11) / float(1 << 53) < rate
                drafts.append(right if hit else right + 1)  # a miss is never the right token
                if not hit and accepted is None:
                    accepted = j
            accepted = limit if accepted is None else accepted
            self._batch.propose(step, b, drafts)
            self._batch.settle(step, b, accepted)
            outcome.rows.append(rows[b])
            outcome.proposed.append(limit)
            outcome.accepted.append(accepted)
            outcome.token_ids.extend(drafts[:accepted])
            if outcome.logprobs is not None and st.logprobs is not None:
                outcome.logprobs.extend(self._logprobs(st, t) for t in drafts[:accepted])
        return outcome

    def _add_state(self, seq: HeldSeq) -> None:
        """How the sequence new in `seq.slot` samples (its seed, its forbidden ids)."""
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        s = seq.sampling
        st = self._seqs[seq.slot] = _SimSeq(
            seed=request_seed(seq.rid, prompt, s),
            num_prompt_tokens=seq.num_prompt_tokens,
            forbidden=self._tokens.forbidden_ids(s),
            allow_eos=not s.ignore_eos and self.config.eos_probability > 0.0,
            logprobs=s.logprobs,
        )
        if seq.slot >= len(self._slot_seeds):
            size = max(2 * len(self._slot_seeds), seq.slot + 1, 64)
            self._slot_seeds = np.resize(self._slot_seeds, size)
            self._slot_prompt_lens = np.resize(self._slot_prompt_lens, size)
        self._slot_seeds[seq.slot] = st.seed
        self._slot_prompt_lens[seq.slot] = st.num_prompt_tokens
        if st.logprobs is None:
            self._logprob_slots.discard(seq.slot)
        else:
            self._logprob_slots.add(seq.slot)
        if not st.forbidden.issubset(self._forbidden.tolist()):
            self._forbidden = np.union1d(self._forbidden, sorted(st.forbidden))

    def _sample(self, step: ExpandedStep) -> tuple[list[int], dict[str, TokenLogprobs]]:
        """A token for each sequence that samples (batch order), appended to its history (the
        next decode computes it). The hot path of a zero-cost run: the tokens are drawn over
        arrays; only a draw that hits a forbidden id, end-of-sequence chances and logprobs
        take the per-sequence path (`TokenSource.token`, the same tokens)."""
        seqs = step.sampled()
        if not seqs:
            return [], {}
        num = len(seqs)
        slots = np.fromiter((s.slot for s in seqs), np.int64, num)
        lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, num)
        ns = (lens - self._slot_prompt_lens[slots]).astype(np.uint64)
        drawn = self._tokens.first_choices(self._slot_seeds[slots], ns)
        token_ids: list[int] = drawn.tolist()
        if self.config.eos_probability > 0.0:
            redo = range(num)
        else:
            redo = np.flatnonzero(np.isin(drawn, self._forbidden)).tolist()
        sims, token = self._seqs, self._tokens.token
        for i in redo:
            st = sims[seqs[i].slot]
            token_ids[i] = token(st.seed, int(ns[i]), st.forbidden, st.allow_eos)
        self._batch.record_samples(seqs, token_ids)
        logprobs: dict[str, TokenLogprobs] = {}
        if self._logprob_slots:
            for seq, tok in zip(seqs, token_ids, strict=True):
                if seq.slot in self._logprob_slots:
                    logprobs[seq.rid] = self._logprobs(sims[seq.slot], tok)
        return token_ids, logprobs

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
