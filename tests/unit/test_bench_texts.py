"""The natural-text workloads of `conveyor bench` (copy, edit, quote: conveyor/bench/texts.py)
made with a model's own tokenizer and chat template (the tiny model's here), their named
scenarios under `--compare`, and the speculation columns a comparison reports."""

from __future__ import annotations

import argparse

import pytest

from conveyor.bench.arrivals import ArrivalConfig
from conveyor.bench.backends import SamplingChoice
from conveyor.bench.cli import build_parser
from conveyor.bench.compare import comparison_rows
from conveyor.bench.compare_plan import Comparison, Scenario, comparison_from_args
from conveyor.bench.spec_figures import drafts
from conveyor.bench.texts import TEXT_WORKLOADS, TEXTS, _tokenizer
from conveyor.bench.workloads import WorkloadConfig, generate
from tests.support.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("name", TEXT_WORKLOADS)
def test_text_workloads_hold_their_texts_in_the_chat_template(tiny: str, name: str) -> None:
    reqs = generate(WorkloadConfig(name=name, num_prompts=6, tokenizer=tiny))
    assert reqs == generate(WorkloadConfig(name=name, num_prompts=6, seed=9, tokenizer=tiny))
    tok = _tokenizer(tiny)
    for r in reqs:
        text = TEXTS[r.index % len(TEXTS)]
        prompt = tok.decode(r.prompt_token_ids)
        assert prompt.startswith("<|im_start|>") and "<|im_start|>assistant\n" in prompt
        assert text.body.strip() in prompt  # the whole text, as given
        body_len = len(tok(text.body)["input_ids"])
        assert r.max_tokens == (96 if name == "quote" else body_len + 32)
        if name == "edit" and text.kind == "code":
            assert f"Rename {text.rename[0]} to {text.rename[1]}" in prompt
        if name == "quote":
            assert text.question in prompt and prompt.endswith('"')
    assert reqs[0].prompt_token_ids != reqs[1].prompt_token_ids  # code, then prose


def test_a_text_workload_needs_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        WorkloadConfig(name="copy")


def _args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def test_text_scenarios_stream_greedy_at_the_asked_concurrency(tiny: str) -> None:
    argv = ["--compare", "speculative=off,ngram", "--scenarios", "copy,mixed,quote",
            "--num-prompts", "4", "--max-concurrency", "4", "--tokenizer", tiny]  # fmt: skip
    c = comparison_from_args(_args(argv), None)  # type: ignore[arg-type]
    assert [s.name for s in c.scenarios] == ["copy", "mixed", "quote"]
    copy, mixed, quote = c.scenarios
    assert copy.workload.tokenizer == tiny and copy.workload.num_prompts == 4
    assert copy.arrivals.max_concurrency == 4 and quote.arrivals.max_concurrency == 4
    assert not copy.sampling.ignore_eos and copy.sampling.temperature == 0.0
    assert mixed.sampling.ignore_eos and mixed.arrivals.max_concurrency is None


def test_speculation_columns_come_from_the_engine_counters() -> None:
    before = {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40,
              "spec_decode_num_accepted_tokens": 20, "spec_decode_num_accepted_tokens_pos_0": 8,
              "spec_decode_num_accepted_tokens_pos_1": 6}  # fmt: skip
    after = {"spec_decode_num_drafts": 30, "spec_decode_num_draft_tokens": 120,
             "spec_decode_num_accepted_tokens": 50, "spec_decode_num_accepted_tokens_pos_0": 24,
             "spec_decode_num_accepted_tokens_pos_1": 14,
             "spec_decode_num_accepted_tokens_pos_2": 4}  # fmt: skip
    spec = drafts(before, after)
    assert spec["spec_draft_tokens"] == 80 and spec["spec_accepted_tokens"] == 30
    assert spec["spec_accepted_share"] == pytest.approx(30 / 80)
    assert spec["spec_accepted_per_pos"] == pytest.approx([16 / 20, 8 / 20, 4 / 20])
    assert drafts({}, {}) == {} and drafts(after, after) == {}  # off, or nothing drafted
    base: dict[str, object] = {
        "completed": 4,
        "output_throughput": 10.0,
        "median_ttft_ms": 100.0,
        "p99_ttft_ms": 200.0,
        "median_tpot_ms": 50.0,
        "p99_tpot_ms": 60.0,
        "p99_itl_ms": 70.0,
        "max_itl_ms": 80.0,
        "num_steps": 100,
        "mean_step_ms": 50.0,
        "mean_decode_step_ms": 50.0,
        "total_output_tokens": 104,
        "num_decode_rows": 100.0,
    }
    # with drafts: 2.5 tokens a decode row, steps 25% longer -> 2.0x predicted; measured 1.8x
    ngram_run = {**base, "output_throughput": 18.0, "total_output_tokens": 254,
                 "mean_decode_step_ms": 62.5, **spec}  # fmt: skip
    runs = {"copy": {"off": base, "ngram": ngram_run}}
    scenario = Scenario("copy", WorkloadConfig(), ArrivalConfig(), SamplingChoice())
    c = Comparison("speculative", ["off", "ngram"], [scenario], None)
    off, ngram = comparison_rows(c, runs)
    assert off["drafts acc %"] is None and ngram["drafts acc %"] == pytest.approx(37.5)
    assert ngram["x off"] == pytest.approx(1.8)
    assert ngram["pred x"] == pytest.approx(2.0) and ngram["of pred %"] == pytest.approx(90.0)
    assert off["pred x"] is None  # the run without drafts predicts nothing of itself
