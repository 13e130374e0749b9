"""The worker's batch between steps and the plan -> flat tensors step.

The batch itself is held_batch.py (the same for every worker): per sequence, in a slot,
its token history (prompt, then outputs, including the tokens this worker sampled), its block
table, computed count and sampling parameters. Plans carry only what changed; the decode token
of a sequence is its own last sample here, never resent.
"""

from __future__ import annotations

import zlib
from typing import Optional

import numpy as np
import torch

from services.worker.held_batch import ExpandedStep, HeldBatch, HeldSeq
from services.worker.model import StepTensors
from shared.protocol.worker_channel import StepPlan


def request_seed(rid: str, seed: Optional[int]) -> int:
    """The client's seed, else a stable function of the rid (crc32, the same in every process
    and run, unlike Python's salted hash())."""
    return seed if seed is not None else zlib.crc32(rid.encode("utf-8"))


class InputBatch:
    """The worker's persistent batch (held_batch.py) and the plan -> StepTensors step."""

    def __init__(self, block_size: int, num_blocks: int, max_model_len: int, device: str) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.device = device
        self.held = HeldBatch(num_blocks, block_size, max_model_len)
        self._seeds: dict[int, int] = {}  # slot -> seed of the sequence in it

    def apply_plan(self, plan: StepPlan) -> ExpandedStep:
        """Move the persistent batch by `plan`; called once per plan before `tensors`. Returns
        the explicit step. Raises ValueError on a plan that does not fit what is held (then
        only a reset plan is accepted)."""
        step = self.held.apply(plan)
        for seq in step.new_seqs:
            self._seeds[seq.slot] = request_seed(seq.rid, seq.sampling.seed)
        return step

    def seed(self, seq: HeldSeq) -> int:
        return self._seeds[seq.slot]

    def tensors(self, step: ExpandedStep, every_row: bool = False) -> StepTensors:
        """The flat step tensors (shapes in StepTensors) for a plan already applied; logits at
        the last row of each sequence that samples (`every_row`: of each one; tools)."""
        bs = self.block_size
        starts = np.asarray(step.start_positions, dtype=np.int64)
        counts = np.asarray(step.num_tokens, dtype=np.int64)
        qsl = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        seq_lens = starts + counts
        seq_of_token = np.repeat(np.arange(len(counts)), counts)  # [T]
        positions = np.arange(qsl[-1]) - qsl[:-1][seq_of_token] + starts[seq_of_token]
        width = int(-(-seq_lens.max() // bs))
        tables = np.zeros((len(step.seqs), width), dtype=np.int64)
        for b, seq in enumerate(step.seqs):
            row = seq.block_ids[:width]
            tables[b, : len(row)] = row
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        sample_rows = qsl[1:] - 1 if every_row else qsl[1:][np.asarray(step.sample, dtype=bool)] - 1
        up = self.upload
        return StepTensors(
            input_ids=up(torch.tensor(step.token_ids(), dtype=torch.int64)),
            positions=up(torch.from_numpy(positions)),
            query_start_loc=up(torch.from_numpy(qsl.astype(np.int32))),
            seq_lens=up(torch.from_numpy(seq_lens.astype(np.int32))),
            block_tables=up(torch.from_numpy(tables.astype(np.int32))),
            slot_mapping=up(torch.from_numpy(slots)),
            logits_indices=up(torch.from_numpy(sample_rows)),
        )

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A CPU tensor onto the step's device. On CUDA through pinned memory, non-blocking: a
        plain copy would wait for every kernel queued before it (step N still running when
        step N+1's inputs are built); the copy is ordered on the stream before the kernels that
        read it, and the pinned buffer is not reused before it is done (torch's host allocator
        records the copy). On the CPU the tensor itself."""
        if self.device == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)
