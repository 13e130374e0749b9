"""The plan -> flat tensors step: what one step's forward reads, built on the step's device.

The batch itself (per sequence its token history, block table, computed count and sampling)
is the held batch (held_batch.py), which the runner moves by each plan; this module reads an
applied step of it and owns the tensors it builds. Plans carry only what changed; the decode
token of a sequence is its own last sample there, never resent.
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.held_batch import ExpandedStep
from services.worker.model import StepTensors
from services.worker.speculate import draft_logits_rows


class InputBatch:
    """Builds a step's StepTensors on `device` (one per worker rank; no state between steps)."""

    def __init__(self, block_size: int, device: str) -> None:
        self.block_size = block_size
        self.device = device

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
        if step.drafts and not every_row:  # speculation: every verified row of a sampler
            sample_rows = np.asarray(draft_logits_rows(step, qsl.tolist()), dtype=np.int64)
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

    def take_device_tokens(
        self, tensors: StepTensors, rows: list[int], tokens: torch.Tensor, src: list[int]
    ) -> None:
        """Pipelined steps: input rows `rows` of a step's tensors take `tokens[src]` (the
        previous step's samples, still only on the device; pipeline.py `device_rows`)."""
        up = self.upload
        tensors.input_ids[up(torch.tensor(rows))] = tokens[up(torch.tensor(src))]
