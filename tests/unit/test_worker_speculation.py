"""Speculative decoding in the worker (services/worker/speculate.py): the n-gram proposer, and
the scheduler driving the model runner on the tiny random model with `--speculative ngram` and
`draft` (a one-layer draft of the two-layer target, and the target as its own draft):
greedy, seeded and penalised text equal to the text without speculation, with drafts proposed,
some accepted and some rejected (a run where speculation never engaged proves nothing), with
one plan in flight or two (results one plan late)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

from services.scheduler import Scheduler, SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.held_batch import HeldSeq
from services.worker.runner import ModelRunner
from services.worker.sim.config import SimConfig
from services.worker.sim.runner import SimRunner
from services.worker.speculate import NgramProposer
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import TokenLogprobs
from tests.support.spec_driver import drive, scheduler_for, tiny_runner
from tests.support.tiny_model import write_tiny_model


def _seq(tokens: list[int], slot: int = 0) -> HeldSeq:
    return HeldSeq("r", slot, list(tokens), 1, len(tokens) - 1, [], SamplingParams(), 0)


def test_ngram_proposes_what_followed_the_latest_earlier_match() -> None:
    proposer = NgramProposer(2)
    seq = _seq([5, 6, 7, 8, 9, 5, 6, 1, 2, 3, 5, 6])
    assert proposer.propose(seq, 3) == [1, 2, 3]  # [5, 6] last ended before 1
    assert proposer.propose(seq, 10) == [1, 2, 3, 5, 6]  # up to the end of the history
    seq.token_ids.extend([4, 4])  # the index follows the history
    assert proposer.propose(seq, 2) == []  # [4, 4] never seen before
    seq.token_ids.extend([4])
    assert proposer.propose(seq, 2) == [4]
    other = _seq([5, 6, 7, 5, 6])  # a new sequence in the same slot: a fresh index
    assert proposer.propose(other, 4) == [7, 5, 6]
    assert NgramProposer(3).propose(_seq([1, 2]), 4) == []


ACCEPTED: dict[str, int] = {}  # rid -> drafts accepted (final outputs' timings, _generate)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def _generate(
    tiny: Path,
    speculative: str,
    sampling: list[SamplingParams],
    two_in_flight: bool,
    logprobs: Optional[dict[str, list[TokenLogprobs]]] = None,
    draft_model: Optional[Path] = None,
) -> tuple[dict[str, list[int]], Scheduler]:
    """Each prompt (a repeated pattern, so n-grams match) with its sampling, all at once; with
    `logprobs`, its logprobs there and the drafts accepted in ACCEPTED."""
    runner = tiny_runner(tiny, speculative, draft_model)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=64,
                             async_scheduling=two_in_flight, num_speculative_tokens=4)  # fmt: skip
    requests = [([(7 * i + j) % 23 + 40 for j in range(6)] * 3, params)
                for i, params in enumerate(sampling)]  # fmt: skip
    run = drive(runner, scheduler_for(runner, config), requests, two_in_flight)
    if logprobs is not None:
        logprobs.update(run.logprobs)
        ACCEPTED.update(run.accepted)
    return run.tokens, run.sched


@pytest.mark.parametrize("two_in_flight", [False, True])
def test_text_with_ngram_speculation_equals_text_without(tiny: Path, two_in_flight: bool) -> None:
    sampling = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=33, temperature=1.0, top_k=5, ignore_eos=True),  # seed: rid
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, ignore_eos=True),
    ]
    plain_lps: dict[str, list[TokenLogprobs]] = {}
    spec_lps: dict[str, list[TokenLogprobs]] = {}
    plain, _ = _generate(tiny, "off", sampling, two_in_flight, plain_lps)
    spec, sched = _generate(tiny, "ngram", sampling, two_in_flight, spec_lps)
    assert spec == plain
    # the request asking for logprobs drafted too: one entry per token, equal to within fp32
    # rounding (its rows come from forwards of other shapes; test_speculation.py says why)
    assert {r for r, lps in spec_lps.items() if lps} == {r for r, lps in plain_lps.items() if lps}
    assert {r for r, lps in plain_lps.items() if lps} == {"r4"}
    assert len(spec_lps["r4"]) == len(plain_lps["r4"]) == 40
    for got, want in zip(spec_lps["r4"], plain_lps["r4"], strict=True):
        assert got.top_token_ids == want.top_token_ids
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=1e-4)
    assert ACCEPTED.pop("r4") > 0, "the logprobs request had no draft accepted"
    stats = sched.stats()
    proposed, accepted = (
        stats["spec_decode_num_draft_tokens"],
        stats["spec_decode_num_accepted_tokens"],
    )
    assert proposed > accepted > 0, (proposed, accepted)  # drafts proposed, some of each fate


@pytest.fixture(scope="module")
def shallow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft for `tiny`: the same seed with one layer of its two (the same embedding and
    first layer), so it agrees with the target often, not always."""
    return write_tiny_model(tmp_path_factory.mktemp("shallow"), num_hidden_layers=1)


def test_text_with_a_draft_model_equals_text_without(tiny: Path, shallow: Path) -> None:
    """Async scheduling. Greedy, seeded and penalised text as without speculation; a sampled
    request without a seed is verified by rejection sampling (its text is a sample, not
    compared)."""
    sampling = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=37, temperature=0.7, top_p=0.9, logprobs=1, ignore_eos=True),
    ]
    plain, _ = _generate(tiny, "off", sampling, True)
    spec_lps: dict[str, list[TokenLogprobs]] = {}
    spec, sched = _generate(tiny, "draft", sampling, True, spec_lps, draft_model=shallow)
    sampled = spec.pop("r4")
    assert spec == {r: t for r, t in plain.items() if r != "r4"}
    assert len(sampled) == len(spec_lps["r4"]) == 37  # one logprob per emitted token
    assert ACCEPTED.pop("r4") > 0 and ACCEPTED.pop("r3") > 0  # rejection sampling accepts too
    stats = sched.stats()
    proposed, accepted = (
        stats["spec_decode_num_draft_tokens"],
        stats["spec_decode_num_accepted_tokens"],
    )
    assert proposed > accepted > 0, (proposed, accepted)  # drafts proposed, some of each fate


def test_the_target_as_its_own_draft_has_its_greedy_drafts_accepted(tiny: Path) -> None:
    sampling = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 2
    spec, sched = _generate(tiny, "draft", sampling, False, draft_model=tiny)
    assert spec == _generate(tiny, "off", sampling, False)[0]
    stats = sched.stats()
    proposed, accepted = (
        stats["spec_decode_num_draft_tokens"],
        stats["spec_decode_num_accepted_tokens"],
    )
    assert proposed > 20 and accepted >= 0.95 * proposed, (proposed, accepted)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny: Path, tmp_path: Path) -> None:
    other = write_tiny_model(tmp_path / "other", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        ModelRunner(WorkerConfig(model=str(tiny), dtype="float32", kv_cache_memory=8 << 20,
                                 speculative="draft", draft_model=str(other)))  # fmt: skip


def _simulated(acceptance: Optional[float]) -> tuple[dict[str, list[int]], Scheduler]:
    """Eight requests on the zero-cost simulated worker, async scheduling, speculation when
    `acceptance` is set."""
    runner = SimRunner(SimConfig(device="none", model="smollm2-135m", num_blocks=256,
                                 spec_acceptance=acceptance))  # fmt: skip
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, num_speculative_tokens=3)
    requests = [([5 + i] * 20, SamplingParams(max_tokens=60 + i, temperature=0.0))
                for i in range(8)]  # fmt: skip
    run = drive(runner, scheduler_for(runner, config), requests, two_in_flight=True)
    return run.tokens, run.sched


def test_the_simulated_worker_accepts_at_its_configured_rate() -> None:
    plain, _ = _simulated(None)
    spec, sched = _simulated(0.7)
    assert spec == plain  # its tokens depend on (request, index) alone
    stats = sched.stats()
    drafts, accepted = (
        stats["spec_decode_num_draft_tokens"],
        stats["spec_decode_num_accepted_tokens"],
    )
    # each position is accepted with 0.7 while all before it were: the expected accepted share
    # of 3 drafts is (0.7 + 0.49 + 0.343) / 3 = 0.511; the draws are deterministic
    assert drafts > 300 and 0.45 < accepted / drafts < 0.57, (drafts, accepted)
    assert (
        stats["spec_decode_num_accepted_tokens_pos_0"]
        > stats["spec_decode_num_accepted_tokens_pos_2"]
    )
