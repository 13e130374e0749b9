"""Stop strings and per-request replies (services/tokenizer/stop_strings.py,
request_state.py): text is cut before the stop string, streamed text never shows part of one,
the engine is told to stop, and `done` carries usage and timings."""

from __future__ import annotations

from typing import Any, Optional

import msgpack
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.request_state import ClientRequest
from services.tokenizer.stop_strings import StopStrings
from shared.protocol.engine_channel import RequestOutput, RequestTimings
from shared.protocol.errors import ErrorCode
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import TokenLogprobs


def byte_tokenizer() -> Tokenizer:
    """One token per byte (GPT-2 byte-level alphabet) plus an end-of-sequence token."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok


TOK = byte_tokenizer()
EOS = TOK.token_to_id("<eos>")


def request(stream: bool, stops: list[str], **sampling: Any) -> ClientRequest:
    prompt = TOK.encode("prompt").ids
    return ClientRequest(
        rid="fe-1-0", client_id="c1", identity=b"id", stream=stream,
        sampling=SamplingParams(**sampling), num_prompt_tokens=len(prompt),
        detokenizer=IncrementalDetokenizer(lambda ids: TOK.decode(ids), prompt),
        stops=StopStrings(stops), received_at=100.0,
    )  # fmt: skip


def out(text: str = "", finish: Optional[str] = None, **kw: Any) -> RequestOutput:
    ids = TOK.encode(text).ids if text else kw.pop("ids", [])
    return RequestOutput("fe-1-0", ids, finish, **kw)


def frames(req: ClientRequest, outputs: list[RequestOutput]) -> list[dict[str, Any]]:
    msgs = []
    for i, o in enumerate(outputs):
        msgs += [msgpack.unpackb(f) for f in req.on_output(o, 101.0 + i).frames]
        req.check_invariants()
    return msgs


# ---- StopStrings -------------------------------------------------------------------------------


def test_find_earliest_stop_in_new_text_only() -> None:
    s = StopStrings(["END", "\n\n", "xy"])
    assert s.find("abc", 0) is None
    m = s.find("a\n\nEND", 1)
    assert m is not None and (m.start, m.stop) == (1, "\n\n")
    assert s.find("aENDb", 5) is None  # already checked before the new text
    m = s.find("aEN" + "D", 3)  # spans the old and the new text
    assert m is not None and m.start == 1
    assert StopStrings([]).find("anything", 0) is None


def test_holdback_is_the_longest_possible_stop_prefix() -> None:
    s = StopStrings(["END", "\n\n"])
    assert s.holdback("abc") == 0
    assert s.holdback("abcE") == 1
    assert s.holdback("abcEN") == 2
    assert s.holdback("abc\n") == 1
    assert s.holdback("ENDx") == 0
    assert StopStrings([]).holdback("abc") == 0


# ---- ClientRequest -----------------------------------------------------------------------------


def test_streamed_text_holds_back_a_possible_stop_then_cuts_it() -> None:
    req = request(stream=True, stops=["STOP"])
    msgs = frames(req, [out("Hello S"), out("T"), out("OP and more")])
    chunks = [m for m in msgs if m["type"] == "chunk"]
    assert [c["text"] for c in chunks] == ["Hello ", "", ""]
    assert "".join(c["text"] for c in chunks) == "Hello "
    done = msgs[-1]
    assert done["type"] == "done" and done["finish_reason"] == "stop"
    assert done["stop_reason"] == "STOP" and "text" not in done
    assert sum(len(c["token_ids"]) for c in chunks) == done["usage"]["completion_tokens"]


def test_stop_string_ends_the_request_and_asks_the_engine_to_abort() -> None:
    req = request(stream=False, stops=["\n"])
    first = req.on_output(out("line one"), 101.0)
    assert not first.frames and not first.finished  # non-streaming: silent until done
    last = req.on_output(out(" end\nnext"), 102.0)
    assert last.finished and last.abort_in_engine and last.finish_reason == "stop"
    done = msgpack.unpackb(last.frames[0])
    assert done["text"] == "line one end"
    assert done["token_ids"] == TOK.encode("line one end\nnext").ids


def test_stop_found_in_the_engines_last_output_needs_no_abort() -> None:
    req = request(stream=False, stops=["!"])
    progress = req.on_output(out("hi!", "length"), 101.0)
    assert progress.finished and not progress.abort_in_engine
    assert msgpack.unpackb(progress.frames[0])["text"] == "hi"


def test_done_carries_usage_timings_and_the_whole_text() -> None:
    req = request(stream=False, stops=[])
    timings = RequestTimings(arrival=50.0, first_scheduled=50.25, first_token=51.0, finished=53.0)
    msgs = frames(req, [out("ab"), out("cd"), out("e", "length", timings=timings)])
    done = msgs[-1]
    assert done["text"] == "abcde" and done["finish_reason"] == "length"
    assert done["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 5,
        "total_tokens": 11,
        "num_cached_tokens": 0,
    }
    t = done["timings"]
    assert t["queue_s"] == 0.25 and t["ttft_s"] == 1.0 and t["e2e_s"] == 3.0
    assert t["tpot_s"] == 2.0 / 4  # first token at 101, last at 103, 4 tokens after the first


def test_eos_and_stop_token_ids() -> None:
    req = request(stream=True, stops=[], stop_token_ids=[TOK.encode("z").ids[0]])
    msgs = frames(req, [out("ab"), out("z", "stop")])
    assert msgs[-1]["stop_reason"] == TOK.encode("z").ids[0]
    req = request(stream=True, stops=[])
    msgs = frames(req, [out("ab"), out(ids=[EOS], finish="stop")])
    assert msgs[-1]["stop_reason"] is None
    assert msgs[-2]["token_ids"] == [EOS] and msgs[-2]["text"] == ""


def test_engine_error_becomes_an_error_reply() -> None:
    req = request(stream=True, stops=[])
    o = out(ids=[], finish="error", error_code=ErrorCode.WORKER_FAILED, error_message="boom")
    progress = req.on_output(o, 101.0)
    assert progress.finished
    err = msgpack.unpackb(progress.frames[0])
    assert (err["type"], err["id"], err["code"]) == ("error", "c1", "worker_failed")


def test_abort_reports_usage_so_far() -> None:
    req = request(stream=True, stops=[])
    frames(req, [out("abc")])
    done = msgpack.unpackb(req.abort(105.0)[-1])
    assert done["finish_reason"] == "abort" and done["usage"]["completion_tokens"] == 3


def test_logprobs_follow_their_tokens() -> None:
    req = request(stream=True, stops=[], logprobs=1)
    lps = [TokenLogprobs(-0.1 * i, [i], [-0.1 * i]) for i in range(3)]
    msgs = frames(req, [out("ab", logprobs=lps[:2]), out("c", "length", logprobs=lps[2:])])
    got = [lp["logprob"] for m in msgs if m["type"] == "chunk" for lp in m["logprobs"]]
    assert got == [0.0, -0.1, -0.2]
    assert frames(request(stream=True, stops=[]), [out("ab")])[0]["logprobs"] is None


def test_unread_requests_detokenize_once_at_the_end_with_the_same_text() -> None:
    """Not streamed and without stop strings, nobody reads the text before the end: tokens are
    taken one by one (on_token) and decoded once; the text equals the streamed one, multi-byte
    characters split across tokens included."""
    ids = TOK.encode("naïve café — ok ✓").ids  # one token per byte: characters span tokens
    texts = []
    for stream in (True, False):
        req = request(stream, [])
        streamed = ""
        for i, token in enumerate(ids[:-1]):
            for f in req.on_token(token, None, 101.0 + i).frames:
                streamed += msgpack.unpackb(f).get("text", "")
        assert stream or not streamed  # silent until done
        final = req.on_output(RequestOutput("fe-1-0", ids[-1:], "length"), 120.0).frames
        done = msgpack.unpackb(final[-1])
        texts.append(req.text)
        assert done["usage"]["completion_tokens"] == len(ids)
    assert texts == ["naïve café — ok ✓"] * 2


# ---- the quiet path (ClientRequest.append_in_place) ----------------------------------------------


def test_only_unstreamed_requests_without_stops_or_logprobs_are_quiet() -> None:
    assert request(stream=False, stops=[]).quiet
    assert not request(stream=True, stops=[]).quiet
    assert not request(stream=False, stops=["x"]).quiet
    assert not request(stream=False, stops=[], logprobs=1).quiet


def test_tokens_appended_in_place_end_with_the_same_done_as_on_token() -> None:
    """The output path appends a quiet request's tokens after the first in place
    (`append_in_place`); the final output detokenizes them all at once, multi-byte characters
    split across tokens included."""
    ids = TOK.encode("héllo 😀 wörld").ids
    by_token, in_place = request(stream=False, stops=[]), request(stream=False, stops=[])
    assert not in_place.in_place  # not before its first token
    for i, token in enumerate(ids[:-1]):
        assert by_token.on_token(token, None, 101.0 + i).frames == ()
        if in_place.in_place:
            in_place.append_in_place(token, 101.0 + i)
        else:
            in_place.on_token(token, None, 101.0 + i)
        in_place.check_invariants()
    assert in_place.in_place and not request(stream=True, stops=[]).in_place
    last = RequestOutput("fe-1-0", ids[-1:], "length")
    done = [msgpack.unpackb(r.on_output(last, 200.0).frames[0]) for r in (by_token, in_place)]
    assert done[0] == done[1]
    assert done[0]["text"] == "héllo 😀 wörld" and done[0]["token_ids"] == ids
