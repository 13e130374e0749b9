"""Incremental detokenization (services/tokenizer/detokenizer.py): pieces never end inside a
UTF-8 character, and together they equal decoding every id at once. (~10 s on a busy machine.)"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.tokenizer.detokenizer import REPLACEMENT, IncrementalDetokenizer

EOS = "<eos>"


def byte_level_tokenizer() -> Tokenizer:
    """GPT-2 style byte-level BPE: one token per byte, plus a merge that crosses a character
    boundary ("©x" = the last byte of "é" followed by "x"), as real vocabularies have."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["©x"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("©", "x")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok


TOK = byte_level_tokenizer()


def decode(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


def stream(ids: list[int], sizes: list[int], prompt: list[int] = ()) -> list[str]:  # type: ignore[assignment]
    detok = IncrementalDetokenizer(decode, list(prompt))
    pieces, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        chunk = ids[i : i + n]
        i += len(chunk)
        k += 1
        pieces.append(detok.push(chunk, final=i >= len(ids)))
    return pieces


@pytest.mark.parametrize("text", ["héllo wörld", "😀 ok", "中文字符", "a€b", "éx"])
def test_multibyte_characters_wait_until_complete(text: str) -> None:
    ids = TOK.encode(text).ids
    pieces = stream(ids, [1])
    assert "".join(pieces) == text
    assert all(REPLACEMENT not in p for p in pieces)
    assert "" in pieces  # at least one step had to wait for the rest of a character


def test_token_crossing_a_character_boundary() -> None:
    ids = TOK.encode("éx").ids
    assert len(ids) == 2  # "Ã" (first byte of é) and "©x"
    detok = IncrementalDetokenizer(decode, [])
    assert detok.push(ids[:1]) == ""
    assert detok.push(ids[1:]) == "éx"


def test_special_tokens_give_no_text() -> None:
    eos = TOK.token_to_id(EOS)
    detok = IncrementalDetokenizer(decode, TOK.encode("prompt ").ids)
    assert detok.push(TOK.encode("hi").ids) == "hi"
    assert detok.push([eos], final=True) == ""


def test_final_push_releases_an_incomplete_character() -> None:
    ids = TOK.encode("ok😀").ids[:-1]  # the emoji's last byte never comes (max_tokens hit)
    detok = IncrementalDetokenizer(decode, [])
    assert detok.push(ids[:2]) == "ok"
    assert detok.push(ids[2:-1]) == ""
    assert detok.push(ids[-1:], final=True) == decode(ids)[2:]
    assert decode(ids).endswith(REPLACEMENT)


def test_prompt_context_is_not_repeated() -> None:
    prompt = TOK.encode("the prompt ends in é").ids
    pieces = stream(TOK.encode(" and more 😀").ids, [2], prompt)
    assert "".join(pieces) == " and more 😀"


@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=1, max_size=30), sizes=st.lists(st.integers(1, 5), min_size=1))
def test_pieces_equal_decoding_everything(text: str, sizes: list[int]) -> None:
    ids = TOK.encode(text).ids
    pieces = stream(ids, sizes)
    assert "".join(pieces) == decode(ids)
    if REPLACEMENT not in text:
        assert all(REPLACEMENT not in p for p in pieces)


@pytest.mark.model
def test_real_model_tokenizer_streams_whole_characters() -> None:
    from services.tokenizer.text_codec import load_text_codec
    from shared.model_files import prepare_model

    codec = load_text_codec(prepare_model(None))
    text = "Crème brûlée 😀🎉 日本語のテキスト — ok"
    ids = codec.encode(text)
    detok = IncrementalDetokenizer(codec.decode, codec.encode("Prompt:"))
    pieces = [detok.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == text == codec.decode(ids)
    assert all(REPLACEMENT not in p for p in pieces)
    assert "" in pieces  # the emoji and the CJK text span several byte-level tokens
