"""The draft-model proposer's own KV (services/worker/draft_model.py), on the tiny model as the
draft of itself: after a proposal whose drafts were partly rejected, the next proposal (which
catches up only on the tokens since and rolls the rejected drafts' K/V back) equals the
proposal of a fresh draft that computes the whole history at once."""

from __future__ import annotations

from pathlib import Path

import structlog

from services.worker.config import WorkerConfig
from services.worker.draft_model import DraftModel, load_draft
from services.worker.held_batch import HeldSeq
from services.worker.runner import ModelRunner
from shared.protocol.sampling import SamplingParams
from tests.support.tiny_model import write_tiny_model


def _seq(tokens: list[int]) -> HeldSeq:
    """A held decode: its history ends with the token this step decodes."""
    return HeldSeq("r", 0, list(tokens), 5, len(tokens), list(range(16)),
                   SamplingParams(temperature=0.0), 0)  # fmt: skip


def test_the_draft_catches_up_and_rolls_back_rejected_drafts(tmp_path: Path) -> None:
    tiny = str(write_tiny_model(tmp_path / "tiny"))
    config = WorkerConfig(model=tiny, dtype="float32", kv_cache_memory=8 << 20, block_size=4,
                          speculative="draft", draft_model=tiny)  # fmt: skip
    runner = ModelRunner(config)
    draft = runner.speculator.proposer if runner.speculator else None
    assert isinstance(draft, DraftModel)

    def fresh() -> DraftModel:  # its own KV pool, nothing computed
        return load_draft(config, runner.args, runner.kv_cache, runner.dtype,
                          runner.max_model_len, structlog.get_logger())  # fmt: skip

    seq = _seq([40, 41, 42, 43, 44, 45, 46])
    first = draft.propose_rows([seq], [4])[0].token_ids
    assert len(first) == 4 and draft.num_forwards == 4
    assert first == fresh().propose_rows([_seq(seq.token_ids)], [4])[0].token_ids
    # two accepted, then the target's own token (not the third draft): the history moves on
    seq.token_ids += first[:2] + [(first[2] + 1) % 200]
    seq.num_computed = len(seq.token_ids)
    again = draft.propose_rows([seq], [3])[0].token_ids
    assert again == fresh().propose_rows([_seq(seq.token_ids)], [3])[0].token_ids
    # every draft accepted, then the target's token: the catch-up covers the last draft too
    seq.token_ids += again + [(again[0] + 5) % 200]
    seq.num_computed = len(seq.token_ids)
    third = draft.propose_rows([seq], [2])[0].token_ids
    assert third == fresh().propose_rows([_seq(seq.token_ids)], [2])[0].token_ids
