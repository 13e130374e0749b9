"""Speculative decoding for constrained rows (structured outputs) on the tiny random model:

1. the mask job with drafts (services/worker/spec_masks.py): row j of a drafting sequence is the
   mask a plain decode gets after x_1..x_j, a draft the grammar refuses has its bit 0 (so it is
   rejected), rows after an end-of-sequence draft allow only end-of-sequence, and the matcher
   keeps only the confirmed outputs;
2. the scheduler driving the model runner with `--speculative ngram` (one plan in flight and
   two): json_schema and regex rows beside plain rows, greedy and seeded, give the same tokens
   as without speculation, their output is valid, and the constrained rows had drafts accepted
   and rejected (prompts that hold the JSON, so n-grams match inside the output);
3. `--speculative draft` with a sampled constrained row without a seed (rejection sampling
   against the masked target) and a greedy one: valid output, the greedy text unchanged.
~4 s."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from test_constraints_worker import SCHEMA  # the tiny model's schema, one definition
from tokenizers import Tokenizer

from services.scheduler import Scheduler, SchedulerConfig
from services.worker.constraints import ConstraintMasks, LlgMatcher
from services.worker.held_batch import HeldSeq
from shared.constraints import GrammarCache, load_tokenizer
from shared.protocol.sampling import Constraint, SamplingParams
from tests.support.spec_driver import drive, scheduler_for, tiny_runner
from tests.support.tiny_model import write_tiny_model

EOS = 2
VOCAB = 265
JSON = Constraint("json_schema", json.dumps(SCHEMA))
REGEX = r"([A-Z]{3}-[0-9]{2} ){1,3}END"
# what the prompts hold: the output's n-grams occur in them, so n-gram drafts are proposed;
# "purple" and "7Q" are drafts the grammars refuse
JSON_TEXT = '{"color": "purple", "n": 7, "ok": true} {"color": "blue", "n": 42, "ok": false}'
REGEX_TEXT = "ABC-12 ABC-7Q ABC-12 ABC-12 END"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def _bits(mask: torch.Tensor, row: int) -> set[int]:
    return {t for t in range(VOCAB) if (int(mask[row, t // 32]) >> (t % 32)) & 1}


def test_the_mask_rows_of_a_drafting_sequence(tiny: Path) -> None:
    tokenizer = load_tokenizer(tiny, VOCAB, [EOS])
    choice = Constraint("choice", json.dumps(["alpha", "beta", "gamma"]))
    beta = tokenizer.tokenize_str("beta")
    params = SamplingParams(max_tokens=20, constraint=choice)
    masks = ConstraintMasks(tiny, VOCAB, [EOS])
    plain = SamplingParams(max_tokens=20)
    other = HeldSeq("p", 1, [9, 10, 11], 3, 3, [], plain, 0)  # unconstrained, first sampler
    seq = HeldSeq("c", 0, [5, 6, beta[0]], 2, 3, [], params, 0)  # one output so far
    fresh = LlgMatcher(GrammarCache(tokenizer).matcher(choice), [EOS])  # a plain decode's
    fresh.advance(beta[0])
    try:
        # drafts: the rest of "beta", EOS, then another EOS (after a stop)
        seq.token_ids += beta[1:] + [EOS, EOS]
        got = masks.wait(masks.start([other, seq], [other, seq], [1, 5]))
        assert got.rows == [2, 3, 4, 5, 6, 7]  # the sequence's rows of the step's logits
        for j in range(4):  # rows 0..3: after the first j drafts, as a plain decode sees them
            want = torch.zeros((1, 9), dtype=torch.int32)
            fresh.fill_mask(want, 0)
            assert _bits(got.bitmask, j) == _bits(want, 0), j
            fresh.advance((beta[1:] + [EOS])[j])
        assert _bits(got.bitmask, 3) == {EOS} and _bits(got.bitmask, 4) == {EOS}  # stopped
        matcher = masks.matcher(seq)
        assert matcher is not None and matcher.num_tokens == 1  # drafts never kept
        # drafts the grammar refuses: "bb"; its bit is 0 in the row before it
        del seq.token_ids[3:]
        seq.token_ids += [beta[1], beta[0], beta[2]]
        got = masks.wait(masks.start([seq], [seq], [3]))
        assert got.rows == [0, 1, 2, 3]
        assert beta[1] in _bits(got.bitmask, 0) and beta[0] not in _bits(got.bitmask, 1)
        assert len(_bits(got.bitmask, 2)) == VOCAB  # past the refusal: never emitted, finite
        # the step accepted "e" and its target sampled "t": the next job catches up with both
        del seq.token_ids[4:]
        seq.token_ids.append(beta[2])
        got = masks.wait(masks.start([seq], [seq]))
        assert _bits(got.bitmask, 0) == {beta[3]} and matcher.num_tokens == 3
    finally:
        masks.close()


def _generate(
    tiny: Path,
    speculative: str,
    requests: list[tuple[list[int], SamplingParams]],
    two_in_flight: bool,
    draft_model: Path | None = None,
) -> tuple[dict[str, list[int]], dict[str, int], Scheduler]:
    """All requests at once: (tokens, drafts accepted) per request, and the scheduler."""
    runner = tiny_runner(tiny, speculative, draft_model)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128, chunk_size=128,
                             async_scheduling=two_in_flight, num_speculative_tokens=4)  # fmt: skip
    run = drive(runner, scheduler_for(runner, config), requests, two_in_flight)
    runner.check_invariants()
    return run.tokens, run.accepted, run.sched


def _requests(tiny: Path, sampled: bool) -> list[tuple[list[int], SamplingParams]]:
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    temp = {"temperature": 0.9, "seed": 5} if sampled else {"temperature": 0.0}
    json_prompt = tok.encode(f"{JSON_TEXT} {JSON_TEXT}\n").ids
    regex_prompt = tok.encode(f"{REGEX_TEXT}\n{REGEX_TEXT}\n").ids
    return [
        (json_prompt, SamplingParams(max_tokens=48, constraint=JSON, **temp)),
        ([(5 * j) % 23 + 40 for j in range(6)] * 3, SamplingParams(max_tokens=30, **temp)),
        (
            regex_prompt,
            SamplingParams(max_tokens=40, constraint=Constraint("regex", REGEX), **temp),
        ),  # fmt: skip
        (
            [(3 * j) % 17 + 60 for j in range(5)] * 3,
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        ),  # fmt: skip
    ]


def _check_valid(tiny: Path, tokens: dict[str, list[int]]) -> None:
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    for rid, check in (("r0", _valid_json), ("r2", _valid_regex)):
        out = tokens[rid]
        assert out and out[-1] == EOS, (rid, out)  # the grammar completed and ended it
        check(tok.decode(out[:-1], skip_special_tokens=False))


def _valid_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def _valid_regex(text: str) -> None:
    import re

    assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize(
    ("sampled", "two_in_flight"), [(False, False), (True, True)], ids=["greedy", "seeded-async"]
)
def test_constrained_rows_draft_and_keep_their_text(
    tiny: Path, sampled: bool, two_in_flight: bool
) -> None:
    requests = _requests(tiny, sampled)
    plain, _, _ = _generate(tiny, "off", requests, two_in_flight)
    spec, accepted, sched = _generate(tiny, "ngram", requests, two_in_flight)
    assert spec == plain
    _check_valid(tiny, spec)
    assert accepted["r0"] > 0 and accepted["r2"] > 0, accepted  # the constrained rows drafted
    stats = sched.stats()
    proposed, total = (
        stats["spec_decode_num_draft_tokens"],
        stats["spec_decode_num_accepted_tokens"],
    )
    assert proposed > total > 0, (proposed, total)  # some accepted, some rejected


def test_a_draft_models_free_constrained_row_stays_valid(tiny: Path) -> None:
    """Rejection sampling (no seed) against the masked target: output the grammar accepts."""
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    prompt = tok.encode(f"{JSON_TEXT} {JSON_TEXT}\n").ids
    free = SamplingParams(max_tokens=48, temperature=0.8, constraint=JSON)  # seed: the rid's
    greedy = SamplingParams(max_tokens=48, temperature=0.0, constraint=JSON)
    requests = [(prompt, free), (prompt, greedy)]
    spec, _, sched = _generate(tiny, "draft", requests, True, draft_model=tiny)
    for rid in ("r0", "r1"):
        assert spec[rid][-1] == EOS
        _valid_json(tok.decode(spec[rid][:-1], skip_special_tokens=False))
    assert spec["r1"] == _generate(tiny, "off", requests, True)[0]["r1"]
    # the draft proposes its unmasked argmax, which the random model's grammar rarely allows:
    # drafts proposed and rejected through the masks (accepted ones: the n-gram test)
    assert sched.stats()["spec_decode_num_draft_tokens"] > 0
