"""SimRunner: handshake, deterministic tokens (never eos, exact length), timing, plan checks."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence

import pytest
import structlog.testing

from services.worker.held_batch import HeldBatch
from services.worker.sim.config import SimConfig
from services.worker.sim.cost_model import step_seconds
from services.worker.sim.profiles import DEVICES, MODELS
from services.worker.sim.runner import SimRunner, kv_capacity_blocks
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import NewSequence, StepPlan, StepResult
from tests.bounds import SLOW_HOST_MARGIN_S

ZERO = SimConfig(device="none", model="smollm2-135m")


def _new(rid: str, prompt: Sequence[int], blocks: list[int], **params) -> NewSequence:
    """A new sequence for a batch of its own (slot 0; `_prefill` renumbers batches of more)."""
    return NewSequence(rid, list(prompt), len(prompt), blocks, SamplingParams(**params), 0)


def _prefill(step: int, seqs: list[NewSequence]) -> StepPlan:
    """A reset plan: `seqs` are the whole batch, each computing its whole prompt."""
    seqs = [dataclasses.replace(s, slot=i) for i, s in enumerate(seqs)]
    total = sum(len(s.token_ids) for s in seqs)
    counts = [len(s.token_ids) for s in seqs]
    return StepPlan(step, None, len(seqs), total, seqs, count_slots=list(range(len(seqs))),
                    counts=counts)  # fmt: skip


def _decode(step: int, num_seqs: int) -> StepPlan:
    """The steady plan: every held sequence decodes its own last sample."""
    return StepPlan(step, step - 1, num_seqs, num_seqs)


def _generate(runner: SimRunner, seq: NewSequence, max_tokens: int) -> list[int]:
    """Drive one request as a scheduler would: one prefill, then decodes, max_tokens in all."""
    out = runner.execute(_prefill(0, [seq])).token_ids
    while len(out) < max_tokens:
        out += runner.execute(_decode(len(out), 1)).token_ids
    return out


def test_ready_message_says_simulated_and_fits_the_memory() -> None:
    r = SimRunner(SimConfig(device="h200", model="llama-3-8b"))
    ready = r.ready_message(rank=0)
    assert ready.device == "sim:h200" and ready.model_name == "sim:llama-3-8b"
    assert ready.eos_token_ids == [128001, 128009] and ready.vocab_size == 128256
    # 141 GB * 0.9 * 0.95 usable - 16.06 GB of weights, over 16 tokens * 128 KiB per block
    usable = 141e9 * 0.9 * 0.95 - MODELS["llama-3-8b"].weight_bytes
    assert ready.num_blocks == int(usable // (16 * 131072))
    assert ready.max_model_len == 8192


def test_a_model_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        SimRunner(SimConfig(device="h200", model="llama-3-70b"))
    fp8 = SimRunner(SimConfig(device="h200", model="llama-3-70b", weight_dtype="float8"))
    assert fp8.num_blocks == kv_capacity_blocks(DEVICES["h200"], fp8.model, 16)


def test_tokens_are_deterministic_never_eos_and_exactly_max_tokens() -> None:
    a, b = SimRunner(ZERO), SimRunner(ZERO)
    seq = _new("req-1", range(10, 30), [0, 1, 2, 3], max_tokens=40, temperature=0.8)
    out_a, out_b = _generate(a, seq, 40), _generate(b, seq, 40)
    assert out_a == out_b and len(out_a) == 40
    assert 2 not in out_a  # SmolLM2's eos
    assert all(256 <= t < 32000 for t in out_a)
    other = _generate(SimRunner(ZERO), _new("req-2", range(10, 30), [0, 1, 2, 3]), 40)
    assert other != out_a  # no seed: the stream follows the request id


def test_seed_and_greedy_streams() -> None:
    seeded = [
        _generate(SimRunner(ZERO), _new(rid, [5, 6, 7], [0], seed=42), 8) for rid in ("x", "y")
    ]
    assert seeded[0] == seeded[1]  # same seed, same tokens whatever the id
    greedy = [
        _generate(SimRunner(ZERO), _new(rid, [5, 6, 7], [0], temperature=0.0), 8)
        for rid in ("x", "y")
    ]
    assert greedy[0] == greedy[1]  # greedy output depends only on the prompt
    assert greedy[0] != seeded[0]


def test_resumed_request_reproduces_its_tokens() -> None:
    runner = SimRunner(ZERO)
    prompt = list(range(100, 112))
    first = _generate(runner, _new("r", prompt, [0, 1]), 6)
    # preempted after 4 outputs: resumed with prompt + 4 outputs, recomputed in one chunk
    resumed = NewSequence("r", prompt + first[:4], len(prompt), [3], SamplingParams(), 1)
    plan = StepPlan(9, 5, 1, 16, [resumed], released_slots=[0], count_slots=[1], counts=[16])
    again = runner.execute(plan)
    assert again.token_ids == [first[4]]


def test_stop_ids_are_avoided_and_eos_only_when_asked() -> None:
    tiny_range = SimConfig(device="none", model="smollm2-135m", token_id_low=300, token_id_high=302)
    out = _generate(SimRunner(tiny_range), _new("s", [9], [0, 1], stop_token_ids=[300]), 20)
    assert out == [301] * 20
    eosy = SimConfig(device="none", model="smollm2-135m", eos_probability=0.5)
    runner = SimRunner(eosy)
    outs = [runner.execute(_prefill(i, [_new(f"e{i}", [9], [i])])).token_ids[0] for i in range(64)]
    assert 10 < outs.count(2) < 54  # about half are eos
    ignoring = [_new(f"i{i}", [9], [i], ignore_eos=True) for i in range(64)]
    assert 2 not in SimRunner(eosy).execute(_prefill(0, ignoring)).token_ids


def _timed(runner: SimRunner, plan: StepPlan) -> tuple[float, StepResult]:
    start = time.perf_counter()
    res = runner.execute(plan)
    return time.perf_counter() - start, res


def test_execute_takes_the_modelled_time(tmp_path) -> None:
    profile = {
        "name": "slow", "dense_flops": None, "attention_flops": None, "bandwidth": None,
        "memory_bytes": 10**9, "launch_s": 0.03, "per_seq_s": 0.01,
    }  # fmt: skip
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(profile))
    runner = SimRunner(SimConfig(profile_path=path, model="smollm2-135m"))
    seqs = [_new(f"t{i}", [7, 8], [i]) for i in range(3)]
    plan = _prefill(0, seqs)
    step = HeldBatch(16, 16, 1024).apply(plan)  # the plan made explicit, as the runner does
    assert step_seconds(runner.device, runner.model, step) == pytest.approx(0.06)  # 30 + 3 * 10 ms
    # The runner promises to return at the modelled deadline, never before; a busy host can
    # only make it later, so the ceiling is the promise plus the slow-host margin.
    elapsed, res = _timed(runner, plan)
    assert 0.06 - 1e-4 <= elapsed < 0.06 + SLOW_HOST_MARGIN_S
    assert res.forward_s >= 0.06 - 1e-4
    zero = SimRunner(ZERO)
    assert step_seconds(zero.device, zero.model, step) == 0.0
    elapsed, _ = _timed(zero, plan)
    assert elapsed < SLOW_HOST_MARGIN_S


def test_logprobs_point_mass() -> None:
    res = SimRunner(ZERO).execute(_prefill(0, [_new("l", [3, 4], [0], logprobs=3)]))
    lp = res.logprobs["l"]
    assert lp.logprob == 0.0 and lp.top_token_ids[0] == res.token_ids[0]
    assert len(lp.top_token_ids) == 3 and lp.top_logprobs == [0.0, -100.0, -100.0]


@pytest.mark.parametrize(
    "plan, message",
    [
        (StepPlan(2, 0, 1, 1), "extends step 0, this worker holds step 1"),
        (StepPlan(2, 1, 2, 2), "for 2 sequences, this worker holds 1"),
        (StepPlan(2, 1, 1, 2), "schedules 2 tokens, this worker's batch computes 1"),
        (StepPlan(2, 1, 1, 2, count_slots=[0], counts=[2]), "past 5 tokens held"),
        (StepPlan(2, 1, 1, 1, count_slots=[3], counts=[0]), "token count to an empty slot"),
        (StepPlan(2, 1, 1, 1, block_slots=[0], block_ids=[10**6]), "outside"),
        (StepPlan(2, 1, 1, 1, released_slots=[4]), "releases slot 4, which holds nothing"),
        (StepPlan(2, 1, 2, 2, new_seqs=[_new("b", [1], [1])]), "takes slot 0, which is held"),
    ],
)
def test_plans_that_break_the_contract_are_refused(plan: StepPlan, message: str) -> None:
    runner = SimRunner(ZERO)
    runner.execute(_prefill(0, [_new("a", [1, 2, 3], [0])]))
    runner.execute(_decode(1, 1))  # "a" holds 5 tokens (two sampled), 4 computed
    with pytest.raises(ValueError, match=message):
        runner.execute(plan)
    with pytest.raises(ValueError, match="holds no batch"):  # until a reset plan
        runner.execute(_decode(2, 1))
    runner.execute(_prefill(3, [_new("a", [1, 2, 3], [0])]))


def test_a_decode_past_the_block_table_is_refused() -> None:
    runner = SimRunner(SimConfig(device="none", model="smollm2-135m", block_size=4))
    runner.execute(_prefill(0, [_new("a", [1, 2, 3], [0])]))
    runner.execute(_decode(1, 1))  # position 3: the block's last slot
    with pytest.raises(ValueError, match="past a block table of 1 blocks"):
        runner.execute(_decode(2, 1))


def test_released_requests_are_forgotten() -> None:
    runner = SimRunner(ZERO)
    runner.execute(_prefill(0, [_new("a", [1, 2, 3], [0])]))
    assert runner.execute(StepPlan(1, 0, 0, 0, released_slots=[0])).token_ids == []
    with pytest.raises(ValueError, match="for 1 sequences, this worker holds 0"):
        runner.execute(_decode(2, 1))


def test_engine_gaps_are_summarized_per_batch_size() -> None:
    runner = SimRunner(SimConfig(device="none", model="smollm2-135m", report_every=3))
    seqs = [_new(f"g{i}", [4, 5], [i]) for i in range(2)]
    with structlog.testing.capture_logs() as logs:
        runner.execute(_prefill(0, seqs))  # a prefill: not a pure decode step
        for step in range(4):
            time.sleep(0.002)  # the "engine" between two steps
            runner.execute(_decode(step + 1, 2))
    gaps = [x for x in logs if x["event"] == "sim_engine_gap"]
    assert len(gaps) == 1  # 4 decode steps, 3 per summary
    assert gaps[0]["num_seqs"] == 2 and gaps[0]["steps"] == 3 and gaps[0]["simulated"] is True
    assert gaps[0]["gap_p50_us"] >= 2000


def test_a_batch_draws_what_each_sequence_would_draw_alone() -> None:
    """The array draw of a batch (SimRunner._sample) gives every sequence exactly the tokens
    `TokenSource.token` gives it alone, forbidden ids redrawn: a narrow id range and stop ids
    make such redraws frequent."""
    config = dataclasses.replace(ZERO, token_id_low=100, token_id_high=110)
    stops = {f"s{i}": [100 + i, 101 + i, 105] for i in range(4)}
    seqs = [_new(f"s{i}", [7, 8, i], [i], stop_token_ids=ids, seed=i)
            for i, (_, ids) in enumerate(stops.items())]  # fmt: skip
    runner = SimRunner(config)
    batch = [runner.execute(_prefill(0, seqs)).token_ids]
    batch += [runner.execute(_decode(n, len(seqs))).token_ids for n in range(1, 12)]
    for i, seq in enumerate(seqs):
        alone = _generate(SimRunner(config), dataclasses.replace(seq, block_ids=[0]), 12)
        assert [step[i] for step in batch] == alone
        assert not set(alone) & set(stops[seq.rid])
