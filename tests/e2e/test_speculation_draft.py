"""Issue 30: `--speculative draft` changes no greedy output of the real model.

An engine of its own whose draft model is the target itself (`--draft-model smollm2`: fp32,
async scheduling and prefix caching on, as the session engine) and the session engine without
speculation get the same greedy requests at once, streamed and not: token ids, text and finish
reasons must be identical, and the speculating engine must have proposed drafts and accepted
nearly all of them (the draft is the target: only a near-tie computed in another batch shape
may differ; at least 90% accepted). Its start loads the model twice (~10-20 s here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import REFERENCE_KV_CACHE_MEMORY, Engine
from tests.e2e.stack_tools import ENGINE_WORKER, engine_settings, running_stack
from tests.e2e.test_speculation import side_by_side  # one runner for both

pytestmark = [pytest.mark.e2e, pytest.mark.model]

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat."
REQUESTS: list[dict[str, Any]] = [
    {"prompt": f"Repeat the sentence twice.\n{TEXT}\n"},
    {"messages": [{"role": "user", "content": "Name three colours."}], "stream": True},
    {"prompt": "The capital of France is"},
]


@pytest.fixture(scope="module")
def draft_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    worker = dataclasses.replace(
        ENGINE_WORKER,
        kv_cache_memory=REFERENCE_KV_CACHE_MEMORY,
        speculative="draft",
        draft_model=ENGINE_WORKER.model or "smollm2",  # the target's own file
    )
    settings = engine_settings(
        tmp_path_factory.mktemp("draft-engine-logs"), gateway=False, worker_config=worker
    )
    for stack in running_stack(settings):
        yield Engine(stack.frontend_address, None, stack.log_dir, stack)


def test_the_target_as_its_own_draft_changes_no_output(
    engine: Engine, draft_engine: Engine
) -> None:
    run = side_by_side(engine, draft_engine, REQUESTS)
    for kw, w, g in zip(REQUESTS, run.want, run.got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), kw
    proposed, accepted = run.num_proposed, run.num_accepted
    assert proposed > 0 and accepted >= 0.9 * proposed, (proposed, accepted)
