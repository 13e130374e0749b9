"""OpenAI-shaped response bodies and stream chunks, for /v1/completions and /v1/chat/completions.

Token strings in logprobs are written "token_id:<id>" (the protocol returns token ids only and
the gateway holds no tokenizer; vLLM's `return_tokens_as_token_ids` uses the same form).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import orjson

from services.gateway.events import ChoiceEnd, TextDelta, TokenLogprob
from services.gateway.openai_schema import EngineCall
from services.gateway.tools import CallOut, read_whole

Kind = Literal["completion", "chat"]

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event holding a JSON object."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def token_text(token_id: int) -> str:
    return f"token_id:{token_id}"


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What every body and chunk of one HTTP request repeats."""

    kind: Kind
    id: str
    created: int
    model: str

    def envelope(self, streaming: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if streaming else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


@dataclass(slots=True)
class ChoiceState:
    """One choice's text and logprobs so far (non-streaming), and its end."""

    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_offsets: list[int] = field(default_factory=list)  # text offset of each logprob's token
    end: Optional[ChoiceEnd] = None
    text_len: int = 0  # characters of text so far

    def add(self, delta: TextDelta) -> None:
        """Non-streaming: keep the delta. A token's text offset is where its delta's text
        starts (exact for one-token deltas; the protocol has no per-token text)."""
        self.text_parts.append(delta.text)
        self.logprobs.extend(delta.logprobs)
        self.token_offsets.extend([self.text_len] * len(delta.logprobs))
        self.text_len += len(delta.text)


def usage(calls: list[EngineCall], ends: list[ChoiceEnd]) -> dict[str, Any]:
    """Prompt tokens once per prompt (n choices share it, as OpenAI counts), output summed;
    `prompt_tokens_details.cached_tokens` counts prompt tokens found in the prefix cache, once
    per prompt like the prompt tokens (the first choice to end speaks for its prompt)."""
    prompt_by_index: dict[int, tuple[int, int]] = {}
    prompt_of_choice = {c.index: c.prompt_index for c in calls}
    for end in ends:
        counts = (end.num_prompt_tokens, end.num_cached_tokens)
        prompt_by_index.setdefault(prompt_of_choice[end.index], counts)
    prompt = sum(p for p, _ in prompt_by_index.values())
    cached = sum(c for _, c in prompt_by_index.values())
    completion = sum(e.num_output_tokens for e in ends)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_logprobs(logprobs: list[TokenLogprob], offsets: list[int]) -> dict[str, Any]:
    """The legacy completions shape: parallel lists per token."""
    return {
        "tokens": [token_text(lp.token_id) for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """The chat shape: one entry per token, each with its top alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        tok = token_text(token_id)
        return {"token": tok, "logprob": logprob, "bytes": list(tok.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
    }


def full_body(
    meta: ResponseMeta,
    states: list[ChoiceState],
    calls: list[EngineCall],
    with_logprobs: bool,
    read_tools: bool = False,
) -> dict[str, Any]:
    """The non-streaming response once every choice ended (`read_tools`: a chat with tools,
    whose replies are read for calls: tools.py)."""
    choices = []
    for index, st in enumerate(states):
        text = "".join(st.text_parts)
        finish = st.end.finish_reason if st.end else None
        if meta.kind == "chat":
            lp = chat_logprobs(st.logprobs) if with_logprobs else None
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if read_tools:
                content, tool_calls = read_whole(text)
                if tool_calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [c.as_openai() for c in tool_calls]}  # fmt: skip
                    finish = "tool_calls"
            choices.append(
                {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}
            )
        else:
            lp = completion_logprobs(st.logprobs, st.token_offsets) if with_logprobs else None
            choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": finish})
    ends = [st.end for st in states if st.end is not None]
    return {**meta.envelope(streaming=False), "choices": choices, "usage": usage(calls, ends)}


def role_chunk(meta: ResponseMeta, index: int, include_usage: bool) -> dict[str, Any]:
    """Chat streams open each choice with the assistant role and empty content."""
    choice = {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return _chunk(meta, choice, include_usage)


def delta_chunk(
    meta: ResponseMeta,
    delta: TextDelta,
    st: ChoiceState,
    with_logprobs: bool,
    include_usage: bool,
) -> dict[str, Any]:
    """One streamed piece of text (advances `st.text_len`, the completions' text_offset)."""
    if meta.kind == "chat":
        lp = chat_logprobs(delta.logprobs) if with_logprobs else None
        choice = {
            "index": delta.index,
            "delta": {"content": delta.text},
            "logprobs": lp,
            "finish_reason": None,
        }
    else:
        offsets = [st.text_len] * len(delta.logprobs)
        lp = completion_logprobs(delta.logprobs, offsets) if with_logprobs else None
        choice = {"index": delta.index, "text": delta.text, "logprobs": lp, "finish_reason": None}
    st.text_len += len(delta.text)
    return _chunk(meta, choice, include_usage)


def tool_call_chunks(
    meta: ResponseMeta, index: int, call: CallOut, include_usage: bool
) -> list[dict[str, Any]]:
    """A complete call as OpenAI streams one: its id, type and name (arguments ""), then its
    arguments."""
    head = {"index": call.index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": ""}}  # fmt: skip
    args = {"index": call.index, "function": {"arguments": call.arguments}}
    return [
        _chunk(
            meta,
            {
                "index": index,
                "delta": {"tool_calls": [part]},
                "logprobs": None,
                "finish_reason": None,
            },
            include_usage,
        )  # fmt: skip
        for part in (head, args)
    ]


def finish_chunk(
    meta: ResponseMeta, end: ChoiceEnd, include_usage: bool, made_calls: bool = False
) -> dict[str, Any]:
    """The last chunk of one choice: no new text, its finish_reason ("tool_calls" when it
    made calls)."""
    if meta.kind == "chat":
        choice = {
            "index": end.index,
            "delta": {},
            "logprobs": None,
            "finish_reason": "tool_calls" if made_calls else end.finish_reason,
        }
    else:
        choice = {
            "index": end.index,
            "text": "",
            "logprobs": None,
            "finish_reason": end.finish_reason,
        }
    return _chunk(meta, choice, include_usage)


def usage_chunk(meta: ResponseMeta, usage_map: dict[str, Any]) -> dict[str, Any]:
    """With stream_options.include_usage: the extra last chunk, no choices, the totals."""
    return {**meta.envelope(streaming=True), "choices": [], "usage": usage_map}


def _chunk(meta: ResponseMeta, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    body = {**meta.envelope(streaming=True), "choices": [choice]}
    if include_usage:
        body["usage"] = None  # OpenAI sends null on every chunk but the last when asked
    return body
