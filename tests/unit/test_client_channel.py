"""Client protocol validation (shared/protocol/client_channel/): every error code it owns,
the documented order of checks, defaults, and the reply shapes."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from shared.protocol.client_channel import (
    MAX_ID_BYTES,
    AbortCommand,
    ClientMessageError,
    GenerateCommand,
    HealthCommand,
    StatsCommand,
    Timings,
    Usage,
    decode_client_message,
    decode_reply,
    done_reply,
    encode_client_message,
    error_reply,
)
from shared.protocol.errors import ErrorCode
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import TokenLogprobs


def pack(msg: Any) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def gen(**fields: Any) -> bytes:
    return pack({"type": "generate", "v": 1, "id": "a", "prompt": "hi", **fields})


def error_of(frame: bytes, max_size: int = 1 << 20) -> ClientMessageError:
    with pytest.raises(ClientMessageError) as info:
        decode_client_message(frame, max_size)
    return info.value


def test_generate_defaults_follow_openai() -> None:
    cmd = decode_client_message(gen())
    assert isinstance(cmd, GenerateCommand)
    assert cmd.prompt == "hi" and cmd.messages is None and cmd.prompt_token_ids is None
    assert cmd.sampling == SamplingParams()
    assert cmd.sampling.max_tokens == 16 and cmd.sampling.temperature == 1.0
    assert (cmd.stream, cmd.priority, cmd.stop, cmd.add_generation_prompt) == (False, 0, [], True)


def test_generate_with_every_param() -> None:
    params = {
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 3,
        "min_p": 0.1,
        "seed": 7,
        "stop": "\n",
        "stop_token_ids": [2],
        "ignore_eos": True,
        "logprobs": 2,
        "repetition_penalty": 1.1,
        "presence_penalty": -1,
        "frequency_penalty": 0.5,
    }
    cmd = decode_client_message(gen(params=params, stream=True, priority=-3))
    assert isinstance(cmd, GenerateCommand)
    s = cmd.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (5, 0, 0.5, 3, 7)
    assert s.stop_token_ids == [2] and s.ignore_eos and s.logprobs == 2
    assert cmd.stop == ["\n"] and cmd.stream and cmd.priority == -3


def test_nil_means_default() -> None:
    cmd = decode_client_message(gen(params={"top_k": None, "temperature": None}, stream=None))
    assert isinstance(cmd, GenerateCommand)
    assert cmd.sampling.top_k is None and cmd.sampling.temperature == 1.0 and not cmd.stream


def test_messages_and_content_parts() -> None:
    msgs = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "name": "ignored",
        },
    ]
    frame = pack({"type": "generate", "v": 1, "id": "m", "messages": msgs})
    cmd = decode_client_message(frame)
    assert isinstance(cmd, GenerateCommand) and cmd.messages is not None
    assert [(m.role, m.content) for m in cmd.messages] == [("system", "be brief"), ("user", "ab")]


def test_other_commands_and_unknown_fields_ignored() -> None:
    assert decode_client_message(pack({"type": "abort", "v": 1, "id": "x"})) == AbortCommand("x")
    assert decode_client_message(pack({"type": "health", "v": 1})) == HealthCommand(None)
    frame = pack({"type": "stats", "v": 1, "id": "q", "future_field": 3})
    assert decode_client_message(frame) == StatsCommand("q")


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"\xc1", ErrorCode.MALFORMED_MESSAGE),
        (pack([1, 2]), ErrorCode.MALFORMED_MESSAGE),
        (pack({"v": 1, "id": "a"}), ErrorCode.UNKNOWN_TYPE),
        (pack({"type": "fly", "v": 1}), ErrorCode.UNKNOWN_TYPE),
        (pack({"type": 3, "v": 1}), ErrorCode.UNKNOWN_TYPE),
        (pack({"type": "health"}), ErrorCode.INVALID_FIELD),
        (pack({"type": "health", "v": "1"}), ErrorCode.INVALID_FIELD),
        (pack({"type": "health", "v": 2}), ErrorCode.UNSUPPORTED_VERSION),
        (pack({"type": "abort", "v": 1}), ErrorCode.INVALID_FIELD),
        (pack({"type": "abort", "v": 1, "id": ""}), ErrorCode.INVALID_FIELD),
        (pack({"type": "abort", "v": 1, "id": "x" * (MAX_ID_BYTES + 1)}), ErrorCode.INVALID_FIELD),
        (pack({"type": "health", "v": 1, "id": 5}), ErrorCode.INVALID_FIELD),
        (gen(stream="yes"), ErrorCode.INVALID_FIELD),
        (gen(priority=1.5), ErrorCode.INVALID_FIELD),
        (gen(params=[1]), ErrorCode.INVALID_FIELD),
        (gen(prompt=5), ErrorCode.INVALID_FIELD),
        (gen(prompt=""), ErrorCode.INVALID_PROMPT),
        (gen(prompt=None), ErrorCode.INVALID_PROMPT),
        (gen(prompt_token_ids=[1, 2]), ErrorCode.INVALID_PROMPT),
        (gen(prompt=None, prompt_token_ids=[]), ErrorCode.INVALID_PROMPT),
        (gen(prompt=None, prompt_token_ids=[1, "2"]), ErrorCode.INVALID_FIELD),
        (gen(prompt=None, messages=[]), ErrorCode.INVALID_PROMPT),
        (gen(prompt=None, messages=[{"content": "x"}]), ErrorCode.INVALID_PROMPT),
        (gen(prompt=None, messages=[{"role": "user", "content": 3}]), ErrorCode.INVALID_PROMPT),
        (gen(prompt=None, messages="hi"), ErrorCode.INVALID_FIELD),
        (gen(params={"temprature": 0}), ErrorCode.INVALID_PARAMS),
        (gen(params={"temperature": -0.1}), ErrorCode.INVALID_PARAMS),
        (gen(params={"temperature": "hot"}), ErrorCode.INVALID_PARAMS),
        (gen(params={"top_p": 0}), ErrorCode.INVALID_PARAMS),
        (gen(params={"top_p": 1.5}), ErrorCode.INVALID_PARAMS),
        (gen(params={"max_tokens": 0}), ErrorCode.INVALID_PARAMS),
        (gen(params={"max_tokens": 2.0}), ErrorCode.INVALID_PARAMS),
        (gen(params={"max_tokens": True}), ErrorCode.INVALID_PARAMS),
        (gen(params={"top_k": 0}), ErrorCode.INVALID_PARAMS),
        (gen(params={"logprobs": 21}), ErrorCode.INVALID_PARAMS),
        (gen(params={"stop": ""}), ErrorCode.INVALID_PARAMS),
        (gen(params={"stop": ["a"] * 17}), ErrorCode.INVALID_PARAMS),
        (gen(params={"stop": [1]}), ErrorCode.INVALID_PARAMS),
        (gen(params={"stop_token_ids": [-1]}), ErrorCode.INVALID_PARAMS),
        (gen(params={"stop_token_ids": "2"}), ErrorCode.INVALID_PARAMS),
        (gen(params={"presence_penalty": 3}), ErrorCode.INVALID_PARAMS),
    ],
)
def test_bad_messages_get_stable_codes(frame: bytes, code: str) -> None:
    assert error_of(frame).code == code


def test_error_carries_the_id_when_readable() -> None:
    assert error_of(gen(params={"max_tokens": 0})).id == "a"
    assert error_of(pack({"type": "nope", "v": 1, "id": "z"})).id == "z"
    assert error_of(pack({"type": "generate", "v": 1, "id": 4})).id is None


def test_frame_size_checked_first() -> None:
    frame = gen(prompt="x" * 100)
    assert error_of(frame, max_size=len(frame) - 1).code == ErrorCode.FRAME_TOO_LARGE
    assert isinstance(decode_client_message(frame, max_size=len(frame)), GenerateCommand)
    assert error_of(b"\xc1" * 10, max_size=5).code == ErrorCode.FRAME_TOO_LARGE


def test_client_encoding_round_trips_through_validation() -> None:
    frame = encode_client_message(
        "generate",
        "r",
        prompt=None,
        prompt_token_ids=[1, 2],
        stream=True,
        params={"max_tokens": 3},
    )
    cmd = decode_client_message(frame)
    assert isinstance(cmd, GenerateCommand)
    assert cmd.prompt_token_ids == [1, 2] and cmd.sampling.max_tokens == 3 and cmd.stream


def test_reply_shapes() -> None:
    err = decode_reply(error_reply(ErrorCode.NOT_READY, "later", "a"))
    assert err == {"type": "error", "v": 1, "id": "a", "code": "not_ready", "message": "later"}
    lp = [TokenLogprobs(-0.5, [3, 4], [-0.5, -1.0])]
    frame = done_reply(
        "a", "length", None, Usage(3, 1), Timings(0.1, 0.2, None, 0.3), whole=("hey", [7], lp)
    )
    done = decode_reply(frame)
    assert done["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 1,
        "total_tokens": 4,
        "num_cached_tokens": 0,
    }
    assert done["timings"] == {"queue_s": 0.1, "ttft_s": 0.2, "tpot_s": None, "e2e_s": 0.3}
    assert (done["text"], done["token_ids"]) == ("hey", [7])
    assert done["logprobs"] == [
        {"logprob": -0.5, "top_token_ids": [3, 4], "top_logprobs": [-0.5, -1.0]}
    ]
    streamed = decode_reply(
        done_reply("a", "stop", "\n", Usage(1, 1), Timings(None, None, None, 1))
    )
    assert "text" not in streamed and streamed["stop_reason"] == "\n"
