"""Turn a step's logits into tokens: penalties, greedy or seeded random draws, logprobs.

Order: grammar masks (constrained rows: disallowed tokens to -inf, services/worker/
constraints.py) -> logit bias -> repetition/presence/frequency penalties -> (greedy: argmax) |
temperature -> top-k -> min-p -> top-p -> draw. Every operation is row-wise, so a row's result
does not depend on what else shares the batch.

Reproducibility: the draw for a request's n-th output token is one uniform number u(seed, n) from
a counter-based generator (SplitMix64 of the seed, mixed with n), turned into a token by inverse
CDF over the filtered distribution in vocabulary order. It depends on (seed, n) alone, so a
request recomputed after preemption draws the same tokens. Requests without a seed get
crc32(rid) (held_batch.request_seed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from services.worker.constraints import RowMasks
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import TokenLogprobs

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_uniform(seed: int, n: int) -> float:
    """u in (0, 1], a pure function of (seed mod 2**64, n): the draw for output token n."""
    z = _splitmix64(_splitmix64(seed & _MASK64) ^ (n & _MASK64))
    return ((z >> 11) + 1) / float(1 << 53)


@dataclass(frozen=True, slots=True)
class SampleRow:
    """What sampling needs of one request at one step."""

    params: SamplingParams
    seed: int
    output_index: int  # n: outputs generated before this one
    token_ids: list[int]  # prompt + outputs so far (penalties)
    num_prompt_tokens: int


def apply_token_masks(logits: torch.Tensor, masks: RowMasks) -> None:
    """In place on logits [S, V]: tokens a row's grammar does not allow become -inf. The
    bitmask (int32 [R, ceil(V / 32)], bit t % 32 of word t // 32) is unpacked on the host with
    numpy on the CPU, on the device elsewhere (only the small bitmask is copied there)."""
    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        bits = np.unpackbits(masks.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits[:, :vocab]).bool()  # [R, V]
    else:
        words = masks.bitmask.to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((words.unsqueeze(2) >> shifts) & 1).view(len(masks.rows), -1)[:, :vocab].bool()
    rows = torch.tensor(masks.rows, dtype=torch.int64, device=logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place on float logits [S, V]: OpenAI's logit_bias, added before anything else reads
    them (ids past the vocabulary were refused at admission)."""
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            pairs = row.params.logit_bias_ids()
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=logits.device)
            vals = torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, vals)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place on logits [S, V]: HF-style repetition penalty over prompt + output, OpenAI-style
    presence and frequency penalties over output tokens."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0 and row.token_ids:
            seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.int64)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        outputs = row.token_ids[row.num_prompt_tokens :]
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and outputs:
            ids = torch.tensor(outputs, dtype=torch.int64, device=logits.device)
            counts = torch.bincount(ids, minlength=vocab)
            counts = counts[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                logits.dtype
            )


def filter_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, top-k, min-p, top-p on random rows [R, V]; filtered entries become -inf."""
    dev = logits.device  # every helper tensor beside the logits: CUDA ops refuse CPU operands
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=dev)
    x = logits / temps[:, None]
    ks = [r.params.top_k for r in rows]
    if any(k is not None and k < x.shape[1] for k in ks):
        kmax = min(max(k or 1 for k in ks), x.shape[1])
        top = torch.topk(x, kmax, dim=1).values  # [R, kmax], descending
        kth = top[torch.arange(len(rows)), [min(k or kmax, kmax) - 1 for k in ks]]
        kth = torch.where(torch.tensor([k is None for k in ks], device=dev), float("-inf"), kth)
        x = x.masked_fill(x < kth[:, None], float("-inf"))
    min_ps = torch.tensor([r.params.min_p for r in rows], dtype=x.dtype, device=dev)
    if bool((min_ps > 0).any()):
        probs = torch.softmax(x, dim=1)
        cut = min_ps[:, None] * probs.max(dim=1, keepdim=True).values
        x = x.masked_fill(probs < cut, float("-inf"))
    top_ps = torch.tensor([r.params.top_p for r in rows], dtype=x.dtype, device=dev)
    which = (top_ps < 1.0).nonzero().flatten()
    if which.numel() > 0:
        sub = x[which]
        sorted_x, order = torch.sort(sub, dim=1, descending=True)
        probs = torch.softmax(sorted_x, dim=1)
        before = torch.cumsum(probs, dim=1) - probs  # mass of strictly better tokens
        drop = before >= top_ps[which][:, None]
        drop[:, 0] = False  # always keep the best token
        sub = sub.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
        x[which] = sub
    return x


def draw(filtered: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Inverse-CDF draw per row, u from (seed, n): [R, V] -> [R] int64."""
    probs = torch.softmax(filtered, dim=1)
    cdf = torch.cumsum(probs, dim=1)
    u = torch.tensor(
        [draw_uniform(r.seed, r.output_index) for r in rows], dtype=cdf.dtype, device=cdf.device
    )
    target = (u * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target).squeeze(1)
    return idx.clamp_(max=filtered.shape[1] - 1)


def processed_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """float [R, V], a copy: what each random row's draw reads (logit bias, penalties over its
    history, temperature and filters; filtered entries -inf). Rejection sampling's p is its
    softmax (services/worker/speculate.py); `logits` is left as it is."""
    x = logits.float().clone()
    apply_logit_bias(x, rows)
    apply_penalties(x, rows)
    return filter_logits(x, rows)


def reads_history(params: SamplingParams) -> bool:
    """Whether sampling reads the token history (penalties), not just the logits and (seed, n)."""
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that reads or changes the distribution: argmax alone decides."""
    return (
        params.greedy
        and params.logprobs is None
        and not params.logit_bias
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
    )


def sample(
    logits: torch.Tensor, rows: list[SampleRow], masks: Optional[RowMasks] = None
) -> tuple[list[int], list[Optional[TokenLogprobs]]]:
    """logits [S, V] in the model's dtype (modified in place) -> one token per row, and
    logprobs where the row's params ask for them (from the processed distribution). `masks`:
    the grammar masks of the constrained rows. When every row is plain greedy the argmax runs
    on the logits as they are (no float copy)."""
    if masks is not None:
        apply_token_masks(logits, masks)
    if all(is_plain_greedy(r.params) for r in rows):
        return logits.argmax(dim=1).tolist(), [None] * len(rows)
    logits = logits.float()
    apply_logit_bias(logits, rows)
    apply_penalties(logits, rows)
    tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    processed = logits
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    rand = [i for i, r in enumerate(rows) if not r.params.greedy]
    if greedy:
        tokens[greedy] = logits[greedy].argmax(dim=1)
    if rand:
        rand_rows = [rows[i] for i in rand]
        filtered = filter_logits(logits[rand], rand_rows)
        tokens[rand] = draw(filtered, rand_rows)
        processed = logits.clone()
        processed[rand] = filtered
    token_list = tokens.tolist()
    return token_list, token_logprobs(processed, rows, token_list)


def token_logprobs(
    processed: torch.Tensor, rows: list[SampleRow], tokens: list[int]
) -> list[Optional[TokenLogprobs]]:
    """Each row's logprobs of its token where its params ask (None elsewhere), from the
    processed logits [R, V] its token was drawn from."""
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[Optional[TokenLogprobs]] = [None] * len(rows)
    if not asked:
        return out
    lp = torch.log_softmax(processed[asked], dim=1)
    kmax = max(rows[i].params.logprobs or 0 for i in asked)
    top = torch.topk(lp, kmax, dim=1) if kmax > 0 else None
    for j, i in enumerate(asked):
        k = rows[i].params.logprobs or 0
        out[i] = TokenLogprobs(
            logprob=float(lp[j, tokens[i]]),
            top_token_ids=top.indices[j, :k].tolist() if top is not None else [],
            top_logprobs=top.values[j, :k].tolist() if top is not None else [],
        )
    return out
