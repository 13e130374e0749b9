"""Embeddings (docs/protocol.md `embed`, docs/gateway.md /v1/embeddings) on the session engine.

The engine's pooled hidden states are compared with transformers' final hidden states (after
the final norm, `last_hidden_state`) of the same fp32 weights: cosine >= 0.9999, for last-token
and mean pooling, for a prompt short enough for one step and one the scheduler must chunk
(chunk_size 256), sent at once so that they share steps. The long prompt is sent again after:
mean pooling must not start from the prefix cache (its second answer is as right as the
first), last-token pooling may. The HTTP route
returns the same vectors in float and base64, and refuses `dimensions` with its code.
"""

from __future__ import annotations

import asyncio
import base64
import math
from pathlib import Path

import httpx
import numpy as np
import pytest

from shared.client import AsyncClient, Client, Embedding, EngineError
from tests.e2e.conftest import Engine, HFReference

MIN_COSINE = 0.9999
LONG_TEXT = (Path(__file__).parent.parent / "data" / "persuasion.txt").read_text()[:2400]
PROMPTS = ["The capital of France is", LONG_TEXT]


def _reference(hf: HFReference, ids: list[int], pooling: str) -> np.ndarray:
    import torch

    with torch.no_grad():
        hidden = hf.model.model(torch.tensor([ids])).last_hidden_state[0]  # [T, Hd]
    vec = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return (vec / vec.norm()).numpy()


def _cosine(a: np.ndarray, b: list[float]) -> float:
    v = np.asarray(b, dtype=np.float64)
    return float(np.dot(a, v) / (np.linalg.norm(a) * np.linalg.norm(v)))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_transformers(
    engine: Engine, hf_reference: HFReference, pooling: str
) -> None:
    ids = [hf_reference.tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    assert len(ids[1]) > 256, "the long prompt must be chunked"
    jobs = [*ids, ids[1]]  # the long one twice: the second may find its blocks cached

    async def embed_all() -> list[Embedding]:
        async with AsyncClient(engine.frontend_address, timeout=300) as client:
            first = await asyncio.gather(
                *(client.embed(prompt_token_ids=x, pooling=pooling) for x in jobs[:2])
            )
            return [*first, await client.embed(prompt_token_ids=jobs[2], pooling=pooling)]

    results = asyncio.run(embed_all())
    for got, prompt_ids in zip(results, jobs, strict=True):
        want = _reference(hf_reference, prompt_ids, pooling)
        assert got.pooling == pooling
        assert got.usage["prompt_tokens"] == len(prompt_ids)
        assert len(got.embedding) == want.shape[0]
        assert math.isclose(np.linalg.norm(got.embedding), 1.0, rel_tol=1e-4)
        assert _cosine(want, got.embedding) >= MIN_COSINE, (pooling, len(prompt_ids))


def test_embed_refusals(engine: Engine) -> None:
    with Client(engine.frontend_address, timeout=60) as client:
        with pytest.raises(EngineError) as bad_pooling:
            client.embed("hello", pooling="max")
        with pytest.raises(EngineError) as empty:
            client.embed("")
    assert bad_pooling.value.code == "invalid_params"
    assert empty.value.code == "invalid_prompt"


def test_http_embeddings(engine: Engine, hf_reference: HFReference) -> None:
    assert engine.http_url is not None
    url = engine.http_url + "/v1/embeddings"
    body = {"input": PROMPTS[0], "encoding_format": "float"}
    as_float = httpx.post(url, json=body, timeout=120)
    assert as_float.status_code == 200, as_float.text
    as_b64 = httpx.post(url, json={**body, "encoding_format": "base64"}, timeout=120).json()
    reply = as_float.json()
    vec = reply["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(as_b64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, np.asarray(vec, dtype=np.float32), atol=1e-6)
    ids = hf_reference.tokenizer(PROMPTS[0], add_special_tokens=False).input_ids
    assert _cosine(_reference(hf_reference, ids, "last"), vec) >= MIN_COSINE
    assert reply["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}
    assert reply["object"] == "list" and reply["data"][0]["object"] == "embedding"
    several = httpx.post(url, json={"input": [ids, ids[:3]]}, timeout=120).json()
    assert [d["index"] for d in several["data"]] == [0, 1]
    assert _cosine(np.asarray(vec), several["data"][0]["embedding"]) >= MIN_COSINE
    assert _cosine(np.asarray(vec), several["data"][1]["embedding"]) < MIN_COSINE
    mixed = httpx.post(url, json={"input": [PROMPTS[0], ids]}, timeout=30)
    assert mixed.status_code == 400 and mixed.json()["error"]["param"].startswith("input")
    refused = httpx.post(url, json={**body, "dimensions": 64}, timeout=30)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "dimensions_unsupported"
    assert refused.json()["error"]["param"] == "dimensions"
