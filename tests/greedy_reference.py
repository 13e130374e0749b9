"""Greedy equality with a reference, tolerant only of the reference's own near-ties.

Two correct fp32 implementations add in different orders, so their logits differ by ~1e-6 to
1e-5 (more on another CPU's kernels). Where the reference's best two logits are closer than
NEAR_TIE, either token is a right greedy choice and the continuations part ways from there
legitimately. Everywhere else the tokens must be equal one for one. An accepted near-tie is
reported as a NearTieWarning (pytest's warnings summary), never silently.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

NEAR_TIE = 1e-4  # 10x the largest fp32 reordering difference seen on these machines' logits


class NearTieWarning(UserWarning):
    """Outputs parted at a near-tie of the reference's logits (see NEAR_TIE)."""


@dataclass(frozen=True)
class NearTie:
    position: int  # index into the generated tokens
    reference_token: int
    got_token: int
    gap: float  # the reference's top-1 minus top-2 logit there


def compare_greedy(
    got: Sequence[int], want: Sequence[int], want_logits: Sequence[torch.Tensor], label: str
) -> Optional[NearTie]:
    """Assert `got` equals `want` (`want_logits[i]`: [vocab], the reference's logits for
    `want[i]`) up to the first near-tie of the reference, where `got` must take one of its two
    best tokens. None when equal over `got`'s length; the NearTie, also warned, otherwise."""
    assert len(got) <= len(want), f"{label}: {len(got)} tokens, the reference made {len(want)}"
    for i, (mine, ref) in enumerate(zip(got, want[: len(got)], strict=True)):
        if mine == ref:
            continue
        top = torch.topk(want_logits[i].float().flatten(), 2)
        gap = float(top.values[0] - top.values[1])
        near = gap < NEAR_TIE and mine in top.indices.tolist()
        assert near, f"{label}: token {i} is {mine}, reference {ref} (top-2 gap {gap:.3g})"
        tie = NearTie(i, ref, mine, gap)
        warnings.warn(NearTieWarning(f"{label}: {tie}"), stacklevel=2)
        return tie
    return None


def hf_greedy_with_logits(
    model: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int, ignore_eos: bool
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' fp32 greedy continuation of each prompt (a model folder), and the logits
    that chose each token: the reference `compare_greedy` takes. `ignore_eos`: every token
    counts, as a request with ignore_eos."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    if ignore_eos:
        hf.generation_config.eos_token_id = None
    out = []
    for ids in prompts:
        x = torch.tensor([list(ids)])
        with torch.no_grad():
            gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                              do_sample=False, output_logits=True, return_dict_in_generate=True,
                              pad_token_id=2)  # fmt: skip
        out.append((gen.sequences[0, len(ids) :].tolist(), [row[0] for row in gen.logits]))
    return out
