"""The real SmolLM2 through the step API against Hugging Face transformers (fp32).

Greedy continuations of 8 chat prompts, prefill chunked at 16 tokens and the sequences
interleaved in mixed steps, must equal transformers' greedy `generate()` token for token; the
logits of a sequence in a mixed batch must equal its logits alone. Exact, except at a near-tie
of the reference's own logits (tests/greedy_reference.py), which the test reports.
Runtime ~60 s on 2 cores.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.worker.config import WorkerConfig
from services.worker.plan_writer import PlanWriter
from services.worker.runner import ModelRunner
from shared.model_files import prepare_model
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import StepPlan
from tests.greedy_reference import compare_greedy
from tests.support.plan_driver import PlanDriver

pytestmark = pytest.mark.model
NUM_NEW_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a fun fact about octopuses.",
]


@pytest.fixture(scope="module")
def folder():
    return prepare_model(None)


@pytest.fixture(scope="module")
def runner(folder) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(
            model=str(folder),
            dtype="float32",
            quantization="none",  # token-exact against transformers on the dequantized weights
            block_size=16,
            kv_cache_memory=256 << 20,
            max_model_len=2048,
        )
    )


@pytest.fixture(scope="module")
def prompts(folder) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def reference(folder, prompts) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy continuations (end-of-sequence ignored, so all are 32 long), each
    with the logits [vocab] that chose each token."""
    from transformers import GenerationConfig, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # else generate() stops at <|im_end|>
    cfg = GenerationConfig(
        max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=2,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    out = []
    with torch.no_grad():
        for ids in prompts:
            # an explicit mask: the prompt holds <|im_end|> (= pad id 2), which generate() would
            # otherwise mask out of attention
            mask = torch.ones(1, len(ids), dtype=torch.long)
            gen = model.generate(torch.tensor([ids]), attention_mask=mask, generation_config=cfg)
            out.append((gen.sequences[0, len(ids) :].tolist(), [s[0] for s in gen.logits]))
    return out


def test_greedy_matches_transformers_in_mixed_chunked_steps(runner, prompts, reference) -> None:
    driver = PlanDriver(
        runner.execute, runner.kv_cache.num_blocks, 16, chunk_size=16, shuffle_seed=0
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    mixed_steps = 0
    for i, ids in enumerate(prompts):
        driver.add(f"p{i}", ids, params)
    # stagger admissions so prefill chunks of late prompts share steps with earlier decodes
    admitted: list[str] = []
    while driver.active():
        if len(admitted) < len(prompts) and driver.step_id % 3 == 0:
            admitted.append(f"p{len(admitted)}")
        live = [r for r in admitted if not driver.seqs[r].done]
        if not live:
            continue
        counts = [
            min(16, len(driver.seqs[r].token_ids) - driver.seqs[r].num_computed) for r in live
        ]
        mixed_steps += int(1 in counts and any(c > 1 for c in counts))
        driver.step(live)
    assert all(len(ids) == NUM_NEW_TOKENS for ids, _ in reference)
    for i, (want, logits) in enumerate(reference):
        got = driver.seqs[f"p{i}"].outputs
        if compare_greedy(got, want, logits, QUESTIONS[i]) is None:
            assert len(got) == NUM_NEW_TOKENS
    assert mixed_steps >= 5


def test_mixed_batch_logits_equal_alone(runner, prompts) -> None:
    greedy = SamplingParams(temperature=0.0)
    base = 10_000  # block ids far from other tests' sequences

    def plan(step: int, rids: list[str], chunks: list[list[int]]) -> StepPlan:
        writer = PlanWriter(first_step_id=step)  # a fresh writer: a reset plan
        news = [
            writer.new_sequence(
                r, c, len(c), [base + 40 * k + j for j in range(-(-len(c) // 16))], greedy
            )
            for k, (r, c) in enumerate(zip(rids, chunks, strict=True))
        ]
        return writer.plan({r: len(c) for r, c in zip(rids, chunks, strict=True)}, news)

    if runner.kv_cache.num_blocks < base + 40 * 4:
        base = runner.kv_cache.num_blocks - 40 * 4
    rng = random.Random(0)
    picks = rng.sample(range(len(prompts)), 4)
    chunks = [prompts[i][: rng.randint(20, len(prompts[i]))] for i in picks]
    rids = [f"m{i}" for i in range(4)]
    together = runner.compute_logits(plan(100, rids, chunks))
    for k in range(4):
        alone = runner.compute_logits(plan(101 + k, [rids[k]], [chunks[k]]))
        assert (together[k] - alone[0]).abs().max().item() < 1e-4
