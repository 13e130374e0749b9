"""Constrained sampling in the worker, on the tiny random model (its byte-level vocabulary makes
llguidance's masks real): every kind of constraint gives output its grammar accepts, greedy and
seeded; a constrained row leaves its unconstrained neighbours' tokens alone; recompute after
preemption rebuilds the matcher from the history (same tokens); two plans in flight and
pipelined steps give the same tokens; logit_bias; the matcher interface (advance, rollback k,
fill mask) speculative decoding will use. Runtime ~10 s."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from services.worker.config import WorkerConfig
from services.worker.constraints import LlgMatcher
from services.worker.runner import ModelRunner
from shared.constraints import GrammarCache, load_tokenizer
from shared.protocol.sampling import Constraint, SamplingParams
from tests.support.plan_driver import PlanDriver
from tests.support.tiny_model import write_tiny_model
from tests.support.two_plan_driver import LockstepWorker, SocketWorker, TwoPlanDriver

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "n", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "regex": Constraint("regex", r"[A-Z]{3}-[0-9]{2}"),
    "choice": Constraint("choice", json.dumps(["alpha", "beta", "gamma"])),
    "lark": Constraint("grammar", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'),
    "gbnf": Constraint("grammar", 'root ::= "yes" | "no" | "maybe"'),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def runner(tiny: Path) -> ModelRunner:
    return _runner(tiny, "off")


def _runner(folder: Path, pipeline: str) -> ModelRunner:
    config = WorkerConfig(model=str(folder), dtype="float32", kv_cache_memory=8 << 20,
                          block_size=16, pipeline_steps=pipeline)  # fmt: skip
    return ModelRunner(config)


def _text(runner: ModelRunner, tokens: list[int]) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(runner.folder / "tokenizer.json"))
    end = tokens.index(EOS) if EOS in tokens else len(tokens)
    return tok.decode(tokens[:end], skip_special_tokens=False)


def _run(runner: ModelRunner, requests: dict[str, tuple[list[int], SamplingParams]],
         preempt: dict[int, str] | None = None) -> dict[str, list[int]]:  # fmt: skip
    driver = PlanDriver(runner.execute, runner.kv_cache.num_blocks, 16, chunk_size=16)
    for rid, (prompt, params) in requests.items():
        driver.add(rid, prompt, params)
    for n in range(10_000):
        if not driver.active():
            break
        if preempt and n in preempt:
            driver.preempt(preempt[n])
        driver.step()
        runner.check_invariants()
    return {rid: s.outputs for rid, s in driver.seqs.items()}


def _accepts(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    patterns = {"regex": r"[A-Z]{3}-[0-9]{2}", "choice": r"alpha|beta|gamma",
                "lark": r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", "gbnf": r"yes|no|maybe"}  # fmt: skip
    return re.fullmatch(patterns[kind], text) is not None


@pytest.mark.parametrize("seed", [None, 3], ids=["greedy", "seeded"])
def test_every_kind_gives_output_its_grammar_accepts(runner: ModelRunner, seed) -> None:
    temperature = 0.0 if seed is None else 1.0
    requests = {
        kind: (
            [5 + i, 40, 41, 42],
            SamplingParams(max_tokens=40, temperature=temperature, seed=seed, constraint=c),
        )  # fmt: skip
        for i, (kind, c) in enumerate(CONSTRAINTS.items())
    }
    for kind, tokens in _run(runner, requests).items():
        assert EOS in tokens, (kind, tokens)  # the grammar ended it: only EOS after that
        assert set(tokens[tokens.index(EOS) :]) == {EOS}, kind
        assert _accepts(kind, _text(runner, tokens)), (kind, _text(runner, tokens))


def test_unconstrained_neighbours_and_recompute_keep_their_tokens(runner: ModelRunner) -> None:
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    constrained = SamplingParams(max_tokens=24, temperature=0.0,
                                 constraint=CONSTRAINTS["json_schema"])  # fmt: skip
    alone = _run(runner, {"p": ([9, 10, 11], plain)})["p"]
    solo_c = _run(runner, {"c": ([12, 13], constrained)})["c"]
    both = _run(runner, {"p": ([9, 10, 11], plain), "c": ([12, 13], constrained)})
    assert both["p"] == alone and both["c"] == solo_c
    again = _run(runner, {"p": ([9, 10, 11], plain), "c": ([12, 13], constrained)},
                 preempt={6: "c", 9: "c"})  # fmt: skip
    assert again == both  # the matcher is rebuilt from prompt + outputs on recompute


def test_two_plans_in_flight_and_pipelined_steps(tiny: Path, runner: ModelRunner) -> None:
    params = {
        kind: SamplingParams(
            max_tokens=30, temperature=0.0 if i % 2 else 0.8, seed=i, constraint=c
        )  # fmt: skip
        for i, (kind, c) in enumerate(CONSTRAINTS.items())
    }
    params["plain"] = SamplingParams(max_tokens=30, temperature=0.0)
    prompts = {rid: [20 + i, 30, 31] for i, rid in enumerate(params)}
    expected = _run(runner, {rid: (prompts[rid], p) for rid, p in params.items()})
    for mode in ("off", "on"):  # off: the worker loop over a socket; on: launched ahead
        pipelined = _runner(tiny, mode)
        worker = LockstepWorker(pipelined) if mode == "on" else SocketWorker(pipelined, False)
        driver = TwoPlanDriver(worker, pipelined.kv_cache.num_blocks, 16, 16)
        try:
            for rid, p in params.items():
                driver.add(rid, prompts[rid], p, frozenset([EOS]))
            outputs = driver.run(lambda d, n: None)
        finally:
            worker.close()
        for rid, got in outputs.items():  # ends at EOS, one extra step computed and dropped
            want = expected[rid]
            assert got == want[: want.index(EOS) + 1] if EOS in want else want, (mode, rid)


def test_logit_bias_forces_and_bans(runner: ModelRunner) -> None:
    plain = SamplingParams(max_tokens=6, temperature=0.0)
    base = _run(runner, {"a": ([7, 8], plain)})["a"]
    forced = SamplingParams(max_tokens=6, temperature=0.0, logit_bias={"77": 100})
    assert _run(runner, {"a": ([7, 8], forced)})["a"] == [77] * 6
    banned = SamplingParams(max_tokens=6, temperature=0.0, logit_bias={str(base[0]): -100})
    assert _run(runner, {"a": ([7, 8], banned)})["a"][0] != base[0]


def test_matcher_interface_advance_rollback_mask(tiny: Path) -> None:
    tokenizer = load_tokenizer(tiny, 265, [EOS])
    cache = GrammarCache(tokenizer)
    m = LlgMatcher(cache.matcher(CONSTRAINTS["choice"]), [EOS])
    mask = torch.full((1, 9), -1, dtype=torch.int32)

    def allowed() -> set[int]:
        m.fill_mask(mask, 0)
        return {t for t in range(265) if (int(mask[0, t // 32]) >> (t % 32)) & 1}

    ids = tokenizer.tokenize_str("beta")
    first = allowed()
    assert ids[0] in first and EOS not in first
    for t in ids:
        assert m.advance(t)
    assert allowed() == {EOS}  # complete: only the end may follow
    m.rollback(len(ids) - 1)
    assert m.num_tokens == 1 and ids[1] in allowed()
    assert not m.advance(ids[0])  # "bb" is no choice: the matcher then allows only EOS
    assert allowed() == {EOS}
    assert cache.num_compiles == 1 and cache.matcher(CONSTRAINTS["choice"]) is not None
    assert cache.num_hits == 1
