"""Step pipelining (`pipeline_steps`) on the real model: the same greedy tokens.

SmolLM2-135M in fp32, one ModelRunner loaded in-process (~3 s; a whole engine would cost a
second model load of 20-60 s on this machine), driven with two plans in flight like the
scheduler under `--async-scheduling` (tests/support/two_plan_driver.py): once through the real
worker loop over a socket with pipelining off (today's path), once through the loop's
pipelined handling with every plan launched on arrival (each decode of a step N sampler reads
its token from step N's device tensor). Five requests share steps (prompt chunks beside
decodes); one chat request ends on the model's EOS, one on a stop token taken from the first
run. Runtime ~10-20 s on the shared 2-core machine.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from shared.protocol.sampling import SamplingParams
from tests.support.two_plan_driver import LockstepWorker, SocketWorker, TwoPlanDriver

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MAX_TOKENS = 20
TEXTS = [
    # SmolLM2's chat format; it answers "The answer is 4." and EOS within 8 tokens
    "<|im_start|>user\nWhat is 2 + 2? Answer with a number.<|im_end|>\n<|im_start|>assistant\n",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors:",
]


def _run(runner: ModelRunner, pipelined: bool, prompts: list[list[int]], stops: dict[int, int]):
    worker = LockstepWorker(runner) if pipelined else SocketWorker(runner, pipeline=False)
    driver = TwoPlanDriver(worker, runner.kv_cache.num_blocks, 16, chunk_size=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    try:
        for i, prompt in enumerate(prompts):
            extra = {stops[i]} if i in stops else set()
            driver.add(f"r{i}", prompt, greedy, frozenset({*runner.eos_token_ids, *extra}))
        before = runner.num_device_inputs
        outputs = driver.run()
        ended = {rid: r.ended for rid, r in driver.requests.items()}
        return outputs, ended, runner.num_device_inputs - before
    finally:
        worker.close()


def test_pipelined_real_model_gives_the_same_greedy_tokens() -> None:
    config = WorkerConfig(dtype="float32", quantization="none", kv_cache_memory=64 << 20,
                          max_model_len=512, pipeline_steps="on")  # fmt: skip
    runner = ModelRunner(config)
    tokenizer = Tokenizer.from_file(str(runner.folder / "tokenizer.json"))
    prompts = [tokenizer.encode(text).ids for text in TEXTS]
    first, first_ended, _ = _run(runner, False, prompts, {})
    assert first_ended["r0"] == "stop"  # the chat request ends on EOS
    # a stop token that fires mid-way: the first output of r3 from its 6th on not seen before
    out = first["r3"]
    cut = next(i for i in range(5, len(out) - 1) if out[i] not in out[:i])
    stops = {3: out[cut]}
    off, off_ended, off_device = _run(runner, False, prompts, stops)
    on, on_ended, on_device = _run(runner, True, prompts, stops)
    assert on == off and on_ended == off_ended
    assert off["r3"] == first["r3"][: cut + 1] and on_ended["r3"] == "stop"
    assert off_device == 0 and on_device > 20  # decodes read step N's tokens on the device
