"""Embedding requests on the worker: pooled final hidden states (docs/protocol.md `embed`).

An embedding request is a prefill-only request whose sampling names a `pooling`; it samples one
token (discarded by the frontend) when its prompt is computed, and this module adds to that
step's result the prompt's pooled final hidden state (after the model's final norm), L2-
normalised, in float32:

* "last": the hidden state at the prompt's last position (decoder models' usual embedding);
* "mean": the mean over every prompt position. A prompt computed in several chunks adds each
  chunk's rows to a running sum, so the scheduler may chunk it like any prefill; it never starts
  one from the prefix cache (those positions would not be computed here).

The runner calls `begin` once per applied step, `pool` with the step's hidden states when
`begin` said the step computes an embedding request, and `take` when it builds the step's
result. A step without embedding requests costs one check of the plan's new sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from services.worker.held_batch import ExpandedStep, HeldSeq

FinalNorm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Pooler:
    """Owns the running sums of mean-pooled sequences and the embeddings of the steps whose
    results are not built yet. Invariant: a sum is kept only for a held pooling sequence that
    has not sampled; a step's embeddings are taken once."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}  # rid -> [Hd] float32, mean pooling so far
        self._live: set[str] = set()  # rids of the pooling sequences held
        self._ready: dict[int, dict[str, torch.Tensor]] = {}  # step_id -> rid -> [Hd]

    def begin(self, step: ExpandedStep, held: Iterable[HeldSeq]) -> bool:
        """After a plan is applied: whether the step computes an embedding request. A sequence
        new to the batch (first scheduled, resumed, or re-sent by a reset) starts its sum over."""
        if not self._live and not any(s.sampling.pooling for s in step.new_seqs):
            return False
        self._live = {s.rid for s in held if s.sampling.pooling is not None}
        for rid in [r for r in self._sums if r not in self._live]:
            del self._sums[rid]  # released (aborted, preempted) or dropped by a reset
        for seq in step.new_seqs:
            self._sums.pop(seq.rid, None)
        return any(s.rid in self._live for s in step.seqs)

    def pool(
        self, step: ExpandedStep, x: torch.Tensor, residual: torch.Tensor, norm: FinalNorm
    ) -> None:
        """Fold the step's rows of embedding requests in; those that sample this step get
        their embedding, kept for `take(step.step_id)`. `x`, `residual`: [T, Hd] (the model's
        `hidden_states`); `norm`: the model's `final_norm`."""
        rows: list[int] = []
        spans: list[tuple[HeldSeq, int, int, bool]] = []  # seq, first row in `rows`, count, samples
        start = 0
        for seq, n, samples in zip(step.seqs, step.num_tokens, step.sample, strict=True):
            kind = seq.sampling.pooling
            if kind == "mean" or (kind == "last" and samples):
                first = start if kind == "mean" else start + n - 1
                spans.append((seq, len(rows), start + n - first, samples))
                rows.extend(range(first, start + n))
            start += n
        if not rows:
            return
        hidden = norm(x, residual, torch.tensor(rows, device=x.device)).float()  # [R, Hd]
        out = self._ready.setdefault(step.step_id, {})
        for seq, at, count, samples in spans:
            if seq.sampling.pooling == "mean":
                part = hidden[at : at + count].sum(dim=0)
                total = self._sums.get(seq.rid)
                self._sums[seq.rid] = part if total is None else total + part
                if not samples:
                    continue
                vec = self._sums.pop(seq.rid) / seq.num_prompt_tokens
            else:
                vec = hidden[at]
            out[seq.rid] = torch.nn.functional.normalize(vec, dim=0)
            self._live.discard(seq.rid)

    def take(self, step_id: int) -> dict[str, list[float]]:
        """The embeddings of step `step_id` (rid -> [Hd]), once; {} when it had none. Copies to
        the host here, when the step's result is built (a pipelined step's launch never
        waits for it)."""
        ready = self._ready.pop(step_id, None)
        if not ready:
            return {}
        return {rid: vec.cpu().tolist() for rid, vec in ready.items()}

    def check_invariants(self) -> None:
        """Read-only; a sum only for a live pooling sequence."""
        assert set(self._sums) <= self._live, (set(self._sums), self._live)
