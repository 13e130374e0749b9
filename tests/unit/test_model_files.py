"""shared/model_files.py: GGUF -> HF folder conversion, caching, errors, and parity with
transformers' own GGUF loader (weights, proving the Q/K row permutation, and tokenizer).
Runtime ~40 s on 2 cores (transformers parses the GGUF in ~11 s; conversion ~10 s when cold)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shared.model_files import (
    SMOLLM2_FILE,
    default_gguf_path,
    eos_token_ids,
    load_folder_weights,
    load_gguf_weights,
    model_name,
    prepare_model,
    read_config,
)
from tests.support.tiny_model import write_tiny_model

TEXTS = [
    "Hello world! How are you today?",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "naïve café, Straße, 日本語, emoji 🙂",
    "def f(x):\n    return x ** 2  # comment",
    "Numbers: 12345 and 3.14159, year 2024",
]


@pytest.fixture(scope="module")
def folder() -> Path:
    return prepare_model(None)


@pytest.fixture(scope="module")
def hf_gguf_model():
    """transformers reading the GGUF itself (needs accelerate; ~11 s)."""
    import transformers

    path = default_gguf_path()
    return transformers.LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name)


def test_converted_folder_layout(folder: Path) -> None:
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = read_config(folder)
    assert (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["vocab_size"],
    ) == (30, 576, 9, 3, 49152)
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["bos_token"] == "<|im_start|>"
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert eos_token_ids(folder) == [2]
    assert model_name(folder) == "SmolLM2-135M-Instruct"
    assert folder.name.startswith("SmolLM2-135M-Instruct")


def test_prepare_model_reuses_the_cache(folder: Path) -> None:
    assert prepare_model("smollm2") == folder
    assert prepare_model(str(default_gguf_path())) == folder
    assert prepare_model(str(folder)) == folder  # an HF folder is used as is


def test_gguf_and_converted_folder_weights_identical(folder: Path) -> None:
    direct = load_gguf_weights(default_gguf_path())
    saved = load_folder_weights(folder)
    assert set(direct) == set(saved) and len(saved) == 272
    for name, w in direct.items():
        assert w.dtype == np.float32 and np.array_equal(w, saved[name]), name


def test_transformers_gguf_loader_gives_our_weights(folder: Path, hf_gguf_model) -> None:
    ours = load_folder_weights(folder)
    theirs = {k: v.detach().float().numpy() for k, v in hf_gguf_model.state_dict().items()}
    for name, w in ours.items():
        assert np.array_equal(w, theirs[name]), name  # q/k rows: the permutation is undone


def test_tokenizer_encodes_like_transformers_gguf_tokenizer(folder: Path) -> None:
    import transformers
    from tokenizers import Tokenizer

    path = default_gguf_path()
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


def test_digits_are_split_one_by_one_like_llama_cpp_smollm(folder: Path) -> None:
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    pieces = ours.encode(TEXTS[-1]).tokens
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == list("12345") + list("314159") + list(
        "2024"
    )


def test_bad_specs_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file or folder"):
        prepare_model(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        prepare_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="no config.json"):
        prepare_model(str(tmp_path))


def _llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (the inverse of ours)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, hf_folder: Path, arch: str = "llama") -> Path:
    import gguf

    cfg = read_config(hf_folder)
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    writer.add_token_merges(
        [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    )
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages }}")
    inverse = {
        v: k
        for k, v in {
            "token_embd.weight": "model.embed_tokens.weight",
            "output_norm.weight": "model.norm.weight",
        }.items()
    }
    for name, w in load_folder_weights(hf_folder).items():
        if name in inverse:
            writer.add_tensor(inverse[name], w)
            continue
        layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
        short = {
            "input_layernorm.weight": "attn_norm.weight",
            "post_attention_layernorm.weight": "ffn_norm.weight",
            "self_attn.q_proj.weight": "attn_q.weight",
            "self_attn.k_proj.weight": "attn_k.weight",
            "self_attn.v_proj.weight": "attn_v.weight",
            "self_attn.o_proj.weight": "attn_output.weight",
            "mlp.gate_proj.weight": "ffn_gate.weight",
            "mlp.up_proj.weight": "ffn_up.weight",
            "mlp.down_proj.weight": "ffn_down.weight",
        }[rest]
        if short == "attn_q.weight":
            w = _llama_cpp_order(w, cfg["num_attention_heads"])
        elif short == "attn_k.weight":
            w = _llama_cpp_order(w, cfg["num_key_value_heads"])
        writer.add_tensor(f"blk.{layer}.{short}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_round_trip_and_concurrent_conversion(tmp_path: Path) -> None:
    hf = write_tiny_model(tmp_path / "hf", seed=3)
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    cache = tmp_path / "cache"
    code = (
        "import sys; from shared.model_files import prepare_model; "
        "print(prepare_model(sys.argv[1]))"
    )
    env = {"CONVEYOR_CACHE_DIR": str(cache), "PYTHONPATH": str(Path.cwd())}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(gguf_path)], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs[0] == outs[1]
    converted = Path(outs[0])
    assert [p.name for p in (cache / "models").iterdir() if ".tmp-" in p.name] == []
    want = load_folder_weights(hf)
    got = load_folder_weights(converted)
    assert set(got) == set(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    from tokenizers import Tokenizer

    a = Tokenizer.from_file(str(hf / "tokenizer.json"))
    b = Tokenizer.from_file(str(converted / "tokenizer.json"))
    for text in TEXTS:
        assert a.encode(text).ids == b.encode(text).ids


def test_unsupported_gguf_architecture_fails_clearly(tmp_path: Path, monkeypatch) -> None:
    hf = write_tiny_model(tmp_path / "hf")
    bad = write_tiny_gguf(tmp_path / "bad.gguf", hf, arch="mamba")
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported"):
        prepare_model(str(bad))
    assert SMOLLM2_FILE.endswith(".gguf")
