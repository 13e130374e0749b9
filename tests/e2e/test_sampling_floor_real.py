"""The temperature floor on the REAL model (docs/protocol.md `temperature`): a temperature
below 1e-5 (here 1e-300, which would be 0 in float32: a division by zero in the sampler) is
greedy, token for token, on SmolLM2 in fp32; above the floor the real sampler samples. The
simulated worker's floor is tested in test_hostile_inputs.py. Uses the session engine.
"""

from __future__ import annotations

from typing import Any

import pytest

from shared.client import Client

pytestmark = [pytest.mark.e2e, pytest.mark.model]

PROMPT = "The conveyor belt carries parcels"


def test_temperature_below_the_floor_is_greedy_on_the_real_model(engine: Any) -> None:
    with Client(engine.frontend_address, timeout=300.0) as c:
        tiny = c.generate(PROMPT, max_tokens=16, temperature=1e-300, seed=5, ignore_eos=True)
        greedy = c.generate(PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True)
        hot = c.generate(PROMPT, max_tokens=16, temperature=1.5, seed=5, ignore_eos=True)
    assert tiny.token_ids == greedy.token_ids
    assert hot.token_ids != greedy.token_ids  # above the floor it samples: the check can fail
