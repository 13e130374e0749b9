"""Workloads: prompts as token ids (so lengths are exact) and output lengths.

Every workload is a pure function of its config: the same seed gives the same requests, token for
token, on any machine. Prompts are random token ids drawn above the special tokens, so no prompt
contains an end-of-sequence or chat-template token by accident; except the natural-text
workloads (copy, edit, quote: texts.py), made with the model's own tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from conveyor.bench.texts import TEXT_WORKLOADS, text_prompts

WORKLOADS = ("random", "uniform", "mixed", "shared-prefix", "chat", "multi-turn", *TEXT_WORKLOADS)

# Ids below this are left out of prompts: tokenizers put their special tokens first
# (SmolLM2: 0-16), and a random <|im_end|> in a prompt would change what the model does.
FIRST_PLAIN_TOKEN_ID = 100

# The mixed-length scenario: prompts 32-512 tokens, outputs 16-256 tokens.
MIXED_INPUT_RANGE = (32, 512)
MIXED_OUTPUT_RANGE = (16, 256)

# Heavy-tailed chat: log-normal lengths (median, sigma), clipped. Real chat traces have a few very
# long prompts and answers among many short ones; sigma 1 gives p99 ~10x the median.
CHAT_INPUT_MEDIAN, CHAT_INPUT_SIGMA, CHAT_INPUT_CLIP = 96, 1.0, (4, 2048)
CHAT_OUTPUT_MEDIAN, CHAT_OUTPUT_SIGMA, CHAT_OUTPUT_CLIP = 64, 0.9, (4, 1024)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload; `index` is its position in the workload (0-based)."""

    index: int
    prompt_token_ids: list[int]
    max_tokens: int  # the output length asked for (exact when EOS is ignored)
    slo_class: Optional[str] = None  # its goodput class, whose targets are sent with it

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """What to generate. `scale` multiplies every length (after drawing), for short runs.

    random: lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)];
    uniform: exactly input_len / output_len; mixed: 32-512 in / 16-256 out;
    shared-prefix: a common `prefix_len`-token system prompt + an `input_len` random suffix;
    chat: heavy-tailed (log-normal) lengths;
    multi-turn: conversations of `num_turns` turns after a common `prefix_len`-token system
    prompt; turn t resends the whole history (its earlier `input_len`-token user messages and
    `output_len`-token replies) and adds a new message. Requests come turn by turn (every
    conversation's turn 0, then turn 1, ...): run it with --max-concurrency = the number of
    conversations so a conversation's next turn starts about when its previous one ends. The
    replies in the history are drawn, not the model's answers (a workload is fixed in advance),
    so a turn can reuse its previous turn's prompt, not that turn's output.
    copy, edit, quote: natural text (texts.py), tokenized by `tokenizer` (a model folder);
    lengths are the texts' own (the length flags and `scale` do not apply).
    """

    name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 256
    num_turns: int = 4  # multi-turn: turns per conversation
    scale: float = 1.0
    vocab_size: int = 49152
    max_model_len: Optional[int] = None  # clip prompt + output to fit, when given
    tokenizer: Optional[str] = None  # copy/edit/quote: the model folder whose tokenizer to use

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; choose from {', '.join(WORKLOADS)}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.num_turns < 1:
            raise ValueError(f"num_turns must be >= 1, got {self.num_turns}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")
        if not 0.0 < self.scale <= 64.0:
            raise ValueError(f"scale must be in (0, 64], got {self.scale}")
        if self.vocab_size <= FIRST_PLAIN_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {FIRST_PLAIN_TOKEN_ID}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.name in TEXT_WORKLOADS and not self.tokenizer:
            raise ValueError(f"workload {self.name!r} needs the model's tokenizer")


def generate(cfg: WorkloadConfig) -> list[BenchRequest]:
    """The workload's requests, deterministic for (cfg)."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_prompts
    if cfg.name == "multi-turn":
        return _multi_turn(rng, cfg)
    if cfg.name in TEXT_WORKLOADS:
        assert cfg.tokenizer is not None  # checked by the config
        prompts = text_prompts(cfg.name, cfg.tokenizer, n)
        return [BenchRequest(i, ids, out_len) for i, (ids, out_len) in enumerate(prompts)]
    prefix: list[int] = []
    if cfg.name == "mixed":
        in_lens = rng.integers(MIXED_INPUT_RANGE[0], MIXED_INPUT_RANGE[1] + 1, n)
        out_lens = rng.integers(MIXED_OUTPUT_RANGE[0], MIXED_OUTPUT_RANGE[1] + 1, n)
    elif cfg.name == "chat":
        in_lens = _lognormal(rng, n, CHAT_INPUT_MEDIAN, CHAT_INPUT_SIGMA, CHAT_INPUT_CLIP)
        out_lens = _lognormal(rng, n, CHAT_OUTPUT_MEDIAN, CHAT_OUTPUT_SIGMA, CHAT_OUTPUT_CLIP)
    else:
        ratio = cfg.range_ratio if cfg.name == "random" else 0.0
        in_lens = _around(rng, n, cfg.input_len, ratio)
        out_lens = _around(rng, n, cfg.output_len, ratio)
        if cfg.name == "shared-prefix":
            prefix_len = _scaled(cfg.prefix_len, cfg.scale) if cfg.prefix_len else 0
            prefix = _token_ids(rng, prefix_len, cfg.vocab_size)
    requests = []
    for i in range(n):
        in_len = _scaled(int(in_lens[i]), cfg.scale)
        out_len = _scaled(int(out_lens[i]), cfg.scale)
        if cfg.max_model_len is not None:
            in_len, out_len = _fit(len(prefix) + in_len, out_len, cfg.max_model_len)
            in_len -= len(prefix)
        ids = prefix + _token_ids(rng, max(in_len, 1), cfg.vocab_size)
        requests.append(BenchRequest(index=i, prompt_token_ids=ids, max_tokens=out_len))
    return requests


def _multi_turn(rng: np.random.Generator, cfg: WorkloadConfig) -> list[BenchRequest]:
    """See WorkloadConfig: `num_prompts` requests, turn-major, ceil(n / num_turns)
    conversations; a conversation whose history outgrows max_model_len ends early."""
    num_convs = -(-cfg.num_prompts // cfg.num_turns)
    system = _token_ids(rng, _scaled(cfg.prefix_len, cfg.scale), cfg.vocab_size)
    if not cfg.prefix_len:
        system = []
    in_len, out_len = _scaled(cfg.input_len, cfg.scale), _scaled(cfg.output_len, cfg.scale)
    history = [list(system) for _ in range(num_convs)]
    requests: list[BenchRequest] = []
    for _turn in range(cfg.num_turns):
        for conv in range(num_convs):
            if len(requests) == cfg.num_prompts:
                return requests
            prompt = history[conv] + _token_ids(rng, in_len, cfg.vocab_size)
            if cfg.max_model_len is not None and len(prompt) + out_len > cfg.max_model_len:
                continue  # this conversation is over: its history no longer fits
            requests.append(BenchRequest(len(requests), prompt, out_len))
            history[conv] = prompt + _token_ids(rng, out_len, cfg.vocab_size)
    return requests


def _around(rng: np.random.Generator, n: int, center: int, ratio: float) -> np.ndarray:
    """n integers uniform in [center * (1 - ratio), center * (1 + ratio)], at least 1."""
    low = max(1, math.floor(center * (1.0 - ratio)))
    high = max(low, math.ceil(center * (1.0 + ratio)))
    return rng.integers(low, high + 1, n)


def _lognormal(
    rng: np.random.Generator, n: int, median: int, sigma: float, clip: tuple[int, int]
) -> np.ndarray:
    draws = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(draws), clip[0], clip[1]).astype(np.int64)


def _scaled(length: int, scale: float) -> int:
    return max(1, round(length * scale))


def _fit(prompt_len: int, out_len: int, max_model_len: int) -> tuple[int, int]:
    """Cut the prompt (then, if need be, the output) so prompt + output <= max_model_len."""
    out_len = max(1, min(out_len, max_model_len - 1))
    prompt_len = min(prompt_len, max_model_len - out_len)
    return prompt_len, out_len


def _token_ids(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_PLAIN_TOKEN_ID, vocab_size, length).tolist()


def summarize(requests: list[BenchRequest]) -> dict[str, float]:
    """Length statistics of a workload (for the report and the analytical model)."""
    ins = [r.prompt_len for r in requests]
    outs = [r.max_tokens for r in requests]
    return {
        "num_requests": float(len(requests)),
        "mean_input_len": float(np.mean(ins)),
        "max_input_len": float(max(ins)),
        "mean_output_len": float(np.mean(outs)),
        "max_output_len": float(max(outs)),
        "total_input_tokens": float(sum(ins)),
        "total_output_tokens": float(sum(outs)),
    }
