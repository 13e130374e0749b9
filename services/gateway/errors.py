"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Errors are values (`ApiError`) that routes return; only pydantic's validation errors arrive as
exceptions, and errors.py turns those into the same shape through one FastAPI handler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from shared.protocol.errors import ErrorCode

# engine error code -> HTTP status. Request-content codes are the client's fault (400); engine
# state codes say "try later" (429 when the queue is full, 503 when the engine can't serve).
_STATUS_BY_ENGINE_CODE: dict[str, int] = {
    ErrorCode.INVALID_FIELD: 400,
    ErrorCode.FRAME_TOO_LARGE: 413,
    ErrorCode.REQUEST_TOO_LARGE: 413,
    ErrorCode.INVALID_PROMPT: 400,
    ErrorCode.INVALID_PARAMS: 400,
    ErrorCode.INVALID_TOKEN_ID: 400,
    ErrorCode.PROMPT_TOO_LONG: 400,
    ErrorCode.INVALID_CONSTRAINT: 400,
    ErrorCode.CONSTRAINT_TOO_LARGE: 400,
    ErrorCode.CONSTRAINT_TOO_SLOW: 400,
    ErrorCode.EMBEDDINGS_UNSUPPORTED: 400,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.SLO_UNATTAINABLE: 429,  # with Retry-After (`retry_after_s`)
    ErrorCode.NOT_READY: 503,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.WORKER_FAILED: 503,
    ErrorCode.ENGINE_UNREACHABLE: 503,  # also what the protocol client raises on silence
}

SLO_RETRY_AFTER_S = 1

_TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


@dataclass(frozen=True, slots=True)
class ApiError:
    status: int
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None
    retry_after_s: Optional[int] = None  # the Retry-After header, when set

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid_param(param: Optional[str], message: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, "invalid_parameter")


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "Incorrect or missing API key (send it as 'Authorization: Bearer <key>')",
        "invalid_request_error",
        None,
        "invalid_api_key",
    )


def from_engine_error(code: str, message: str) -> ApiError:
    """An engine (protocol client) error -> the HTTP error a client should see."""
    status = _STATUS_BY_ENGINE_CODE.get(code, 500)
    # a latency target out of reach now may be in reach once the queue drains: a second is
    # the scale of the waits it was predicted on
    retry = SLO_RETRY_AFTER_S if code == ErrorCode.SLO_UNATTAINABLE else None
    return ApiError(status, message, _TYPE_BY_STATUS.get(status, "server_error"), None, code,
                    retry)  # fmt: skip


def from_validation_errors(errors: Sequence[Any]) -> ApiError:
    """pydantic/FastAPI validation errors -> one 400 naming the first bad field.

    `loc` looks like ("body", "messages", 0, "role"); the param is written the way a client
    wrote it: "messages[0].role".
    """
    if not errors:
        return invalid_param(None, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid_param(None, "request body is not valid JSON")
    prefix, label = _split_at_union(first.get("loc", ()))
    if label is not None:
        # Each member of a union reports its own mismatch: name the accepted shapes instead.
        labels = [lb for lb in (_split_at_union(e.get("loc", ()))[1] for e in errors) if lb]
        param = _param_path(prefix)
        shapes = ", ".join(dict.fromkeys(labels))
        return invalid_param(param, f"{param}: must be one of: {shapes}")
    param = _param_path(first.get("loc", ()))
    message = str(first.get("msg", "invalid value"))
    return invalid_param(param, f"{param}: {message}" if param else message)


def _split_at_union(loc: Sequence[Any]) -> tuple[list[Any], Optional[str]]:
    """(loc up to the first union member label, that label or None)."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and _is_union_member_label(part):
            return list(loc[:i]), part
    return list(loc), None


def _param_path(loc: Sequence[Any]) -> Optional[str]:
    path = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or None


def _is_union_member_label(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict["))
