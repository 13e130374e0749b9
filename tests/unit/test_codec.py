"""The internal codec: round trips and stable error codes for bad frames."""

import msgpack
import pytest

from shared.protocol import codec
from shared.protocol.engine_channel import OutputBatch, RequestOutput
from shared.protocol.errors import ErrorCode
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import NewSequence, StepPlan, StepResult, TokenLogprobs


def _plan() -> StepPlan:
    seq = NewSequence("r1", [1, 2, 3], 3, [0], SamplingParams(temperature=0.0, seed=7), 1)
    return StepPlan(4, 3, 2, 4, [seq], [1], [0], [5], [1], [3])


def test_round_trip_plan_and_result() -> None:
    plan = _plan()
    assert codec.decode(codec.encode(plan)) == plan
    res = StepResult(4, [9], {"r1": TokenLogprobs(-0.5, [9, 3], [-0.5, -1.5])}, 0.01)
    assert codec.decode(codec.encode(res)) == res


def test_a_result_is_one_integer_per_sampled_sequence() -> None:
    """Results name no rids (the scheduler maps tokens by batch position): 256 samples of
    ids below 65,536 take at most 3 bytes each, plus the envelope."""
    res = StepResult(1_000_000, [49_000 + i for i in range(256)], forward_s=0.004)
    assert len(codec.encode(res)) <= 3 * 256 + 80  # 841 bytes


@pytest.mark.parametrize(
    "frame, code",
    [
        (b"\xc1", ErrorCode.MALFORMED_MESSAGE),
        (msgpack.packb([1, 2]), ErrorCode.MALFORMED_MESSAGE),
        (msgpack.packb({"type": "nope"}), ErrorCode.UNKNOWN_TYPE),
        (msgpack.packb({"step_id": 1}), ErrorCode.UNKNOWN_TYPE),
        (
            msgpack.packb({"type": "step_result", "step_id": "x", "token_ids": []}),
            ErrorCode.INVALID_FIELD,
        ),
        (
            msgpack.packb({"type": "step_result", "token_ids": []}),
            ErrorCode.INVALID_FIELD,
        ),
        (
            msgpack.packb({"type": "step_result", "step_id": 1, "token_ids": [1, "2"]}),
            ErrorCode.INVALID_FIELD,
        ),
    ],
)
def test_bad_frames_have_stable_codes(frame: bytes, code: str) -> None:
    with pytest.raises(codec.DecodeError) as info:
        codec.decode(frame)
    assert info.value.code == code


def test_invalid_sampling_inside_a_message_is_invalid_field() -> None:
    wire = msgpack.unpackb(codec.encode(_plan()))
    wire["new_seqs"][0]["sampling"]["top_p"] = 0.0
    with pytest.raises(codec.DecodeError) as info:
        codec.decode(msgpack.packb(wire))
    assert info.value.code == ErrorCode.INVALID_FIELD
    assert "top_p" in info.value.message


def test_frame_size_limit() -> None:
    with pytest.raises(codec.DecodeError) as info:
        codec.decode(codec.encode(_plan()), max_size=10)
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE


@pytest.mark.parametrize(
    ("column", "bad"),
    [
        ("block_ids", [1, "2"]),  # a block id that is not an int
        ("block_ids", [1, True]),  # bool is not int on the wire
        ("block_slots", [0, None]),
        ("counts", [2, 1.5]),
        ("released_slots", "01"),
    ],
)
def test_columns_are_checked_element_by_element(column: str, bad: list) -> None:
    plan = StepPlan(1, 0, 2, 3, [], [3], [0, 1], [1, 2], [1], [2])
    wire = msgpack.unpackb(codec.encode(plan))
    wire[column] = bad
    with pytest.raises(codec.DecodeError) as info:
        codec.decode(msgpack.packb(wire))
    assert info.value.code == ErrorCode.INVALID_FIELD and column in info.value.message


def test_a_steady_plan_of_256_decodes_is_a_few_dozen_bytes() -> None:
    """Nothing new, nothing finished: the plan names no sequence (issue 18: < 200 bytes)."""
    steady = StepPlan(1_000_000, 999_999, 256, 256)
    frame = codec.encode(steady)
    assert len(frame) < 200 and codec.decode(frame) == steady
    # the empty columns are left out of the frame, and default to empty on decode
    assert set(msgpack.unpackb(frame)) == {
        "type", "step_id", "prev_step_id", "num_seqs", "num_scheduled_tokens"
    }  # fmt: skip


def test_output_batch_round_trip_and_column_check() -> None:
    final = RequestOutput("b", [9], "stop", [], 3, 4)
    batch = OutputBatch(7, ["a"], [5], {"a": TokenLogprobs(-0.5, [5], [-0.5])}, [final])
    back = codec.decode(codec.encode(batch))
    assert back == batch and [o.rid for o in back.as_outputs()] == ["a", "b"]
    wire = msgpack.unpackb(codec.encode(batch))
    wire["token_ids"] = []
    with pytest.raises(codec.DecodeError) as info:
        codec.decode(msgpack.packb(wire))
    assert info.value.code == ErrorCode.INVALID_FIELD
