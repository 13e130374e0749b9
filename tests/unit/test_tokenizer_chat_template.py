"""Chat templates and prompt admission (services/tokenizer/chat_template.py, text_codec.py,
admission.py): SmolLM2's own template renders as Hugging Face does, the sandbox holds, and
prompts are checked against the model's limits with stable codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.tokenizer.admission import Rejection, prompt_ids
from services.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from services.tokenizer.text_codec import TextCodec, load_text_codec
from shared.protocol.client_channel import ChatMessage, GenerateCommand
from shared.protocol.engine_channel import EngineReady
from shared.protocol.errors import ErrorCode
from shared.protocol.sampling import SamplingParams

# SmolLM2-135M-Instruct's template, as its GGUF and tokenizer_config.json carry it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
USER = [ChatMessage("user", "Hi there")]


def test_smollm2_template_adds_default_system_prompt_and_generation_prompt() -> None:
    text = ChatTemplate(SMOLLM2_TEMPLATE).render(USER)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    chat = [ChatMessage("system", "Be brief."), *USER]
    text = ChatTemplate(SMOLLM2_TEMPLATE).render(chat, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"


def test_template_helpers_and_special_tokens() -> None:
    source = (
        "{{ bos_token }}{{ messages | tojson }}{% if messages|length > 1 %}"
        "{{ raise_exception('one message only') }}{% endif %}{{ eos_token }}"
    )
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert (
        template.render([ChatMessage("user", "é")]) == '<s>[{"role": "user", "content": "é"}]</s>'
    )
    with pytest.raises(ChatTemplateError, match="one message only"):
        template.render(USER * 2)


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",  # attribute escape
        "{{ messages.append(1) }}",  # mutation
        "{{ ''.__class__.__subclasses__() }}",
    ],
)
def test_sandbox_refuses_unsafe_templates(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(USER)


def test_broken_template_is_a_load_error() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for x in %}")


# ---- text codec and admission --------------------------------------------------------------


def write_model_folder(folder: Path, template: str | None) -> Path:
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}
    if template is not None:
        config["chat_template"] = [{"name": "default", "template": template}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


ENGINE = EngineReady("m", max_model_len=64, vocab_size=258, eos_token_ids=[257], num_blocks=8,
                     block_size=16)  # fmt: skip


def command(**kw: object) -> GenerateCommand:
    sampling = kw.pop("sampling", SamplingParams(max_tokens=4))
    return GenerateCommand(id="x", sampling=sampling, **kw)  # type: ignore[arg-type]


def test_codec_encodes_chat_with_the_templates_own_special_tokens(tmp_path: Path) -> None:
    codec = load_text_codec(write_model_folder(tmp_path, SMOLLM2_TEMPLATE))
    ids = codec.encode_chat([ChatMessage("system", "s"), ChatMessage("user", "u")], True)
    start, end = 256, 257
    assert ids[0] == start and ids.count(start) == 3 and ids.count(end) == 2
    assert codec.decode(ids) == "system\ns\nuser\nu\nassistant\n"  # special tokens skipped
    assert start not in codec.encode("plain") and end not in codec.encode("plain")
    assert codec.decode(codec.encode("plain text")) == "plain text"


def test_admission_codes(tmp_path: Path) -> None:
    codec = load_text_codec(write_model_folder(tmp_path, "{{ '' }}"))
    cases = [
        (command(prompt_token_ids=[1, 258]), ErrorCode.INVALID_TOKEN_ID),
        (command(prompt_token_ids=[-1]), ErrorCode.INVALID_TOKEN_ID),
        (command(messages=USER), ErrorCode.INVALID_PROMPT),  # renders to no tokens
        (command(prompt="x" * 61), ErrorCode.PROMPT_TOO_LONG),  # 61 + 4 > 64
        (command(prompt="x", sampling=SamplingParams(stop_token_ids=[999])),
         ErrorCode.INVALID_PARAMS),
    ]  # fmt: skip
    for cmd, code in cases:
        result = prompt_ids(cmd, codec, ENGINE)
        assert isinstance(result, Rejection) and result.code == code, cmd
    assert prompt_ids(command(prompt="x" * 60), codec, ENGINE) == codec.encode("x" * 60)
    assert prompt_ids(command(prompt_token_ids=[0, 257]), codec, ENGINE) == [0, 257]


def test_model_without_template_refuses_messages(tmp_path: Path) -> None:
    codec = load_text_codec(write_model_folder(tmp_path, None))
    assert isinstance(codec, TextCodec) and not codec.has_chat_template
    result = prompt_ids(command(messages=USER), codec, ENGINE)
    assert isinstance(result, Rejection) and result.code == ErrorCode.INVALID_PROMPT


@pytest.mark.model
def test_real_model_template_matches_its_tokens() -> None:
    from shared.model_files import prepare_model

    codec = load_text_codec(prepare_model(None))
    ids = codec.encode_chat(USER, True)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|>, <|im_end|>
    assert codec.encode("Hello") != [] and codec.encode("Hello")[0] != 1  # no BOS on raw text
