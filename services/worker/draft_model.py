"""The draft-model proposer of `--speculative draft --draft-model PATH` (docs/design/
speculation.md): a second, smaller model with the target's vocabulary, run by the worker on the
decodes a plan gave a draft limit.

* **Its own KV**: a KVCache of the draft's shape with as many blocks as the target's pool,
  indexed by the target's block tables (one table serves both: a draft never needs a block the
  scheduler did not give, and the scheduler's accounting of draft slots covers it). Its bytes
  are the target's block count times the draft's bytes per block (logged at start).
* **Catching up**: per held sequence, how many leading positions of the draft's KV are valid.
  At a proposal, positions from there to the end of the history (the prompt the first time,
  then the tokens accepted since) are computed in one batched forward of every drafting row,
  whose last logits give the first draft. A draft written past what was accepted is rolled back
  for free: the valid count is capped by what the target has confirmed (its computed count less
  the decode token), so a rejected draft's position is computed again.
* **Proposing**: then one single-token forward per further draft, up to each row's limit.
  Greedy and seeded rows take the draft's argmax (they are verified against the target's own
  draw, speculate.py); a sampled row without a client seed draws from the draft's own processed
  distribution q (temperature and filters), which is kept for rejection sampling
  (draft_rejection.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from services.worker.config import WorkerConfig, resolve_quantization
from services.worker.draft_rejection import Drafts, draws_freely
from services.worker.held_batch import ExpandedStep, HeldSeq
from services.worker.input_batch import InputBatch
from services.worker.kv_cache import KVCache
from services.worker.loading import load_model
from services.worker.model import LlamaModel
from services.worker.parallel import SingleRank
from services.worker.sampler import SampleRow, filter_logits
from services.worker.weights import ModelArgs, model_args
from shared.model_files import prepare_model, source_gguf

DRAFT_SEED = 0  # the draft's own generator (rows without a client seed), seeded at start


def load_draft(
    config: WorkerConfig,
    target: ModelArgs,
    target_kv: KVCache,
    dtype: torch.dtype,
    max_model_len: int,
    log: Any,
) -> DraftModel:
    """The draft model of `config.draft_model`, in the target's dtype, with its KV pool;
    ValueError when its vocabulary size differs from the target's."""
    folder = prepare_model(config.draft_model)
    args = model_args(folder)
    if args.vocab_size != target.vocab_size:
        raise ValueError(
            f"--draft-model {config.draft_model!r} has a vocabulary of {args.vocab_size} "
            f"tokens, the target {target.vocab_size}: a draft must share the target's tokenizer"
        )
    gguf = source_gguf(folder)
    quantization = resolve_quantization(config, gguf is not None)
    model = load_model(config, args, folder, gguf, quantization, dtype, SingleRank(),
                       max_model_len, log)  # fmt: skip
    kv = KVCache(args, target_kv.num_blocks, target_kv.block_size, target_kv.dtype_name,
                 config.device)  # fmt: skip
    log.info("draft_model_loaded", model=str(config.draft_model), layers=args.num_layers,
             hidden_size=args.hidden_size, kv_cache_bytes=kv.num_bytes)  # fmt: skip
    return DraftModel(model, kv, config.device)


class DraftModel:
    """The draft model and its KV: the one owner of what the draft has computed per sequence."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, device: str) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.inputs = InputBatch(kv_cache.block_size, device)
        self.generator = torch.Generator(device=device).manual_seed(DRAFT_SEED)
        # slot -> (the sequence, leading positions whose draft K/V may be valid)
        self._computed: dict[int, tuple[HeldSeq, int]] = {}
        self.num_forwards = 0

    def forget(self, seqs: list[HeldSeq]) -> None:
        """Called with the sequences a plan released."""
        for seq in seqs:
            entry = self._computed.get(seq.slot)
            if entry is not None and entry[0] is seq:
                del self._computed[seq.slot]

    def propose_rows(self, seqs: list[HeldSeq], limits: list[int]) -> list[Drafts]:
        """Up to `limits[i]` (> 0) drafts for each of `seqs` (decodes: each history ends with
        the token this step decodes, and its table covers `limits[i]` more positions). Runs
        max(limits) forwards of the draft, the first one catching every row up."""
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        free = [draws_freely(s) for s in seqs]
        for r in range(max(limits)):
            live = [i for i, limit in enumerate(limits) if limit > r]
            logits = self._forward([self._part(seqs[i], drafts[i]) for i in live])  # [R, V]
            picked, q = self._pick(logits, [seqs[i] for i in live], [free[i] for i in live])
            for row, i in enumerate(live):
                drafts[i].append(picked[row])
                if q[row] is not None:
                    probs[i].append(q[row])
        for seq, own in zip(seqs, drafts, strict=True):  # K/V written up to the last draft fed
            self._computed[seq.slot] = (seq, len(seq.token_ids) + len(own) - 1)
        pairs = zip(drafts, probs, strict=True)
        return [Drafts(d, torch.stack(p) if p else None) for d, p in pairs]

    def _part(self, seq: HeldSeq, drafts: list[int]) -> tuple[HeldSeq, int, int]:
        """(a read-only view of `seq` with its drafts so far, first position, tokens) of one
        row's forward: from the draft's valid count to the end the first time, else the last
        draft."""
        if drafts:
            view = dataclasses.replace(seq, token_ids=seq.token_ids + drafts)
            return view, len(view.token_ids) - 1, 1
        entry = self._computed.get(seq.slot)
        valid = entry[1] if entry is not None and entry[0] is seq else 0
        start = min(valid, seq.num_computed - 1)  # rejected drafts' positions are past it
        return seq, start, len(seq.token_ids) - start

    def _forward(self, parts: list[tuple[HeldSeq, int, int]]) -> torch.Tensor:
        """The draft's forward over the rows' tokens, writing its own KV: logits [R, V] at
        each row's last token."""
        self.num_forwards += 1
        step = ExpandedStep(
            step_id=self.num_forwards,  # the draft's own forward count: no plan's id
            seqs=[p[0] for p in parts],
            start_positions=[p[1] for p in parts],
            num_tokens=[p[2] for p in parts],
            sample=[True] * len(parts),
            new_seqs=[],
            released=[],
        )
        logits = self.model.forward(self.inputs.tensors(step), self.kv_cache.layers)
        assert logits is not None  # a single rank
        return logits

    def _pick(
        self, logits: torch.Tensor, seqs: list[HeldSeq], free: list[bool]
    ) -> tuple[list[int], list[Optional[torch.Tensor]]]:
        """Each row's draft: the argmax, or a draw from q for rows that draw freely (with q)."""
        picked = logits.argmax(dim=1).tolist()
        q: list[Optional[torch.Tensor]] = [None] * len(seqs)
        rows = [i for i, f in enumerate(free) if f]
        if rows:
            params = [SampleRow(seqs[i].sampling, seqs[i].seed, 0, [], 0) for i in rows]
            dist = torch.softmax(filter_logits(logits[rows].float(), params), dim=1)  # [F, V]
            drawn = torch.multinomial(dist, 1, generator=self.generator).flatten().tolist()
            for j, i in enumerate(rows):
                picked[i], q[i] = drawn[j], dist[j]
        return picked, q
