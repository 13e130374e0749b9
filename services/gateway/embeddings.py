"""POST /v1/embeddings: OpenAI's embeddings route over the frontend's `embed` (docs/gateway.md).

Each input (a string, or a list of token ids) is one engine `embed`: a prefill-only request
batched by the scheduler with everything else, answered with the prompt's pooled final hidden
state, L2-normalised (services/worker/pooling.py). The inputs of one HTTP request run at once;
the first failure cancels the others (which aborts them in the engine) and is the response.
`encoding_format` "base64" is the float32 little-endian bytes, base64-encoded (OpenAI's).
`dimensions` is refused (the model's hidden size is the only size), so is another `model`.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Annotated, Literal, Optional, Union

import numpy as np
from pydantic import Field

from services.gateway.errors import ApiError, from_engine_error, invalid_param
from services.gateway.openai_schema import GatewayLimits, TokenId, _Body
from shared.client import AsyncClient, Embedding, EngineError

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request

TokenList = Annotated[list[TokenId], Field(min_length=1)]
EmbeddingInput = Union[
    Annotated[str, Field(min_length=1)],
    Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)],
    TokenList,
    Annotated[list[TokenList], Field(min_length=1)],
]


class EmbeddingRequest(_Body):
    input: EmbeddingInput
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    pooling: Literal["last", "mean"] = "last"  # ours: which positions the vector pools


def plan_embeddings(
    req: EmbeddingRequest, limits: GatewayLimits
) -> Union[list[dict[str, object]], ApiError]:
    """The `embed` keyword arguments of each input, in order, or why the request is refused."""
    if req.model is not None and req.model != limits.served_model_name:
        message = f"The model '{req.model}' does not exist"
        return ApiError(404, message, "invalid_request_error", "model", "model_not_found")
    if req.dimensions is not None:
        return ApiError(400, "dimensions is not supported: embeddings have the model's hidden "
                        "size", "invalid_request_error", "dimensions",
                        "dimensions_unsupported")  # fmt: skip
    inputs = req.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]  # type: ignore[list-item]
    if len(inputs) > MAX_INPUTS:
        return invalid_param("input", f"at most {MAX_INPUTS} inputs per request")
    return [
        {"prompt": x, "pooling": req.pooling}
        if isinstance(x, str)
        else {"prompt_token_ids": x, "pooling": req.pooling}
        for x in inputs
    ]


async def run_embeddings(
    client: AsyncClient,
    calls: list[dict[str, object]],
    request_id: str,
    traceparent: Optional[str] = None,
) -> Union[list[Embedding], ApiError]:
    """Every input's embedding, in order; the first engine error cancels the others."""
    tasks = [
        asyncio.ensure_future(
            client.embed(**call, request_id=f"{request_id}-{i}", traceparent=traceparent)  # type: ignore[arg-type]
        )
        for i, call in enumerate(calls)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    except EngineError as exc:
        return from_engine_error(exc.code, exc.message)
    finally:  # a failed input, or the route cancelled: the others are aborted in the engine
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def embeddings_body(
    results: list[Embedding], encoding_format: str, model: str
) -> dict[str, object]:
    """OpenAI's response: one `embedding` object per input, in input order, and the usage."""
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(r.embedding, encoding_format)}
        for i, r in enumerate(results)
    ]
    num_tokens = sum(r.usage["prompt_tokens"] for r in results)
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _encoded(vector: list[float], encoding_format: str) -> Union[list[float], str]:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
