"""Shared e2e fixtures: ONE real engine per test session, and the transformers reference.

`engine` starts the real stack through LocalStack (tokenizer, scheduler, worker with the real
SmolLM2 in fp32, and the HTTP gateway when services.gateway exists) on free loopback ports, and
stops it at the end of the session. Tests that must break an engine (kill its worker, drain it)
start their own instead of using this one.

`reference_engine` is a second real engine with the two engine-level optimisations off
(`--no-async-scheduling --no-enable-prefix-caching`): what the session engine, which has both
on, must match token for token (test_async_scheduling.py, test_prefix_caching.py). One per
session: a model load costs ~20-60 s on the shared 2-core machine.

`hf_reference` loads transformers' fp32 model from the same converted folder, once per session.

`make test` runs this folder as two processes side by side (tests/run_all.py): with
CONVEYOR_E2E_PART=engine only the tests that use one of these session fixtures (one process
holds the engines), with CONVEYOR_E2E_PART=stacks only the others (each starts what it needs).
Unset: every test.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

from conveyor.bench.steplog import with_step_columns
from conveyor.launcher import LocalStack
from services.scheduler.config import SchedulerConfig
from tests.e2e.stack_tools import ENGINE_WORKER, engine_settings

READY_TIMEOUT_S = 600.0  # model load on a busy 2-core machine; normally ~15-40 s
PART_ENV = "CONVEYOR_E2E_PART"
ENGINE_FIXTURES = frozenset({"engine", "reference_engine", "hf_reference"})


def e2e_part(item: pytest.Item) -> str:
    """The part a test belongs to: "engine" when it uses a session fixture that starts or
    loads the real model, directly or through its other fixtures, else "stacks"."""
    return "engine" if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) else "stacks"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    part = os.environ.get(PART_ENV)
    if not part:
        return
    if part not in ("engine", "stacks"):
        raise pytest.UsageError(f"{PART_ENV} must be engine or stacks, got {part!r}")
    keep = [item for item in items if e2e_part(item) == part]
    dropped = [item for item in items if e2e_part(item) != part]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@dataclass(frozen=True)
class Engine:
    """What tests get: where to reach the shared engine and where its logs are."""

    frontend_address: str  # the client protocol (docs/protocol.md)
    http_url: Optional[str]  # the OpenAI-compatible gateway, None when not started
    log_dir: Path  # <service>.log files (JSON lines)
    stack: LocalStack  # pids and settings; do not stop or break it

    def log_records(self, service: str) -> list[dict[str, Any]]:
        """Every JSON line of one service's log so far (step lines with their per-request
        lists: conveyor/bench/steplog.py `with_step_columns`)."""
        path = self.log_dir / f"{service}.log"
        out = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return list(with_step_columns(out))


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    stack = LocalStack(engine_settings(tmp_path_factory.mktemp("engine-logs")))
    stack.start()
    try:
        stack.wait_ready(timeout=READY_TIMEOUT_S)
        yield Engine(stack.frontend_address, stack.http_url, stack.log_dir, stack)
    finally:
        stack.stop()


# The reference engine's KV pool: the tests that use it run a few short requests at once
# (~1k tokens in all); 128 MiB is ~2.9k tokens in fp32, and leaves memory to the other engines.
REFERENCE_KV_CACHE_MEMORY = 128 << 20


@pytest.fixture(scope="session")
def reference_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The session engine's settings without overlap scheduling and prefix caching."""
    settings = engine_settings(
        tmp_path_factory.mktemp("reference-engine-logs"),
        gateway=False,
        scheduler_config=SchedulerConfig(async_scheduling=False, enable_prefix_caching=False),
        worker_config=dataclasses.replace(ENGINE_WORKER, kv_cache_memory=REFERENCE_KV_CACHE_MEMORY),
    )
    stack = LocalStack(settings)
    stack.start()
    try:
        stack.wait_ready(timeout=READY_TIMEOUT_S)
        yield Engine(stack.frontend_address, None, stack.log_dir, stack)
    finally:
        stack.stop()


@dataclass(frozen=True)
class HFReference:
    """transformers' fp32 model and tokenizer on the converted folder the engine serves."""

    model: Any
    tokenizer: Any

    def greedy(self, prompt: str, max_new_tokens: int) -> tuple[list[int], str, list[Any]]:
        """Greedy continuation of a raw prompt (no chat template): (new ids, their text, the
        logits [vocab] that chose each id)."""
        import torch

        ids = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.eos_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new_ids = out.sequences[0, ids.shape[1] :].tolist()
        logits = [step[0] for step in out.logits]
        return new_ids, self.tokenizer.decode(new_ids, skip_special_tokens=True), logits


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.model_files import prepare_model

    folder = prepare_model(None)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return HFReference(model=model, tokenizer=AutoTokenizer.from_pretrained(folder))
