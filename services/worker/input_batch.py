"""Per-request worker state and the plan -> flat tensors step.

The worker keeps, per live request, only what plans told it: its token history (prompt, then
outputs, including the tokens this worker sampled), its block table and its sampling parameters.
State is dropped on `released_rids`; a rid in `new_seqs` replaces any earlier state (a resumed
request after preemption starts afresh from the plan).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from services.worker.model import StepTensors
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import NewSequence, StepPlan, check_plan


@dataclass(slots=True)
class RequestState:
    rid: str
    token_ids: list[int]  # prompt, then outputs (what penalties look at)
    num_prompt_tokens: int
    block_ids: list[int]  # the block table
    sampling: SamplingParams
    seed: int  # sampling.seed, or crc32 of the rid when the client gave none

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def request_seed(rid: str, seed: Optional[int]) -> int:
    """The client's seed, else a stable function of the rid (crc32, the same in every process
    and run, unlike Python's salted hash())."""
    return seed if seed is not None else zlib.crc32(rid.encode("utf-8"))


class InputBatch:
    """Owns RequestState per rid; turns each StepPlan into StepTensors."""

    def __init__(self, block_size: int, num_blocks: int, max_model_len: int, device: str) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.device = device
        self.requests: dict[str, RequestState] = {}

    def apply_plan(self, plan: StepPlan) -> list[RequestState]:
        """Update state from `plan` (release, add, extend tables and histories); called once
        per plan before `tensors`. Returns the scheduled requests in plan order. Raises
        ValueError on a plan inconsistent with what the worker knows."""
        check_plan(plan)
        for rid in plan.released_rids:
            self.requests.pop(rid, None)
        for seq in plan.new_seqs:
            if any(not 0 <= b < self.num_blocks for b in seq.block_ids):
                raise ValueError(f"rid {seq.rid!r}: block id outside [0, {self.num_blocks})")
            self.requests[seq.rid] = _new_state(seq)
        new_rids = {seq.rid for seq in plan.new_seqs}
        states: list[RequestState] = []
        offset = 0
        for i, rid in enumerate(plan.rids):
            state = self.requests.get(rid)
            if state is None:
                raise ValueError(f"step {plan.step_id}: rid {rid!r} is neither new nor live")
            start, n = plan.start_positions[i], plan.num_tokens[i]
            # a new sequence's block_ids is its whole table: skip blocks it already lists
            known = set(state.block_ids) if rid in new_rids else set()
            added = [b for b in plan.new_block_ids[i] if b not in known]
            if any(not 0 <= b < self.num_blocks for b in added):
                raise ValueError(f"rid {rid!r}: block id outside [0, {self.num_blocks})")
            state.block_ids.extend(added)
            end = start + n
            if end > self.max_model_len:
                raise ValueError(f"rid {rid!r}: position {end - 1} >= max_model_len")
            if end > len(state.block_ids) * self.block_size:
                raise ValueError(f"rid {rid!r}: block table too short for position {end - 1}")
            if start > len(state.token_ids):
                raise ValueError(f"rid {rid!r}: chunk starts at {start}, beyond its tokens")
            chunk = plan.token_ids[offset : offset + n]
            state.token_ids[start:end] = chunk
            offset += n
            states.append(state)
        return states

    def tensors(self, plan: StepPlan, states: list[RequestState]) -> StepTensors:
        """The flat step tensors (shapes in StepTensors) for a plan already applied."""
        bs = self.block_size
        starts = np.asarray(plan.start_positions, dtype=np.int64)
        counts = np.asarray(plan.num_tokens, dtype=np.int64)
        qsl = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        seq_lens = starts + counts
        seq_of_token = np.repeat(np.arange(len(counts)), counts)  # [T]
        positions = np.arange(qsl[-1]) - qsl[:-1][seq_of_token] + starts[seq_of_token]
        width = int(-(-seq_lens.max() // bs))
        tables = np.zeros((len(states), width), dtype=np.int64)
        for b, state in enumerate(states):
            row = state.block_ids[:width]
            tables[b, : len(row)] = row
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        sample_rows = qsl[1:][np.asarray(plan.sample, dtype=bool)] - 1
        dev = self.device
        return StepTensors(
            input_ids=torch.tensor(plan.token_ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            logits_indices=torch.from_numpy(sample_rows).to(dev),
        )

    def record_samples(self, states: list[RequestState], token_ids: list[int]) -> None:
        """Append each sampled token to its request's history (called after sampling), so
        penalties and the seed counter see it before the scheduler sends it back."""
        for state, tok in zip(states, token_ids, strict=True):
            state.token_ids.append(tok)


def _new_state(seq: NewSequence) -> RequestState:
    return RequestState(
        rid=seq.rid,
        token_ids=list(seq.token_ids),
        num_prompt_tokens=seq.num_prompt_tokens,
        block_ids=list(seq.block_ids),
        sampling=seq.sampling,
        seed=request_seed(seq.rid, seq.sampling.seed),
    )
