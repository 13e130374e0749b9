"""Rejection sampling of a draft model's proposals (Leviathan et al. 2023, Chen et al. 2023).

Used for sampled requests that gave no seed, when the drafts come from a draft model that drew
them from its own distribution `q` (services/worker/draft_model.py). Seeded and greedy requests
keep the exact rule of speculate.py (each draft checked against the target's own draw
u(seed, n)), so their text with speculation equals the text without; n-gram drafts have no `q`
(a point mass), for which that rule already is rejection sampling.

The rule, per drafting row with drafts x_1..x_d drawn from q_1..q_d, and the target's processed
distributions p_1..p_{d+1} at the same rows (row j after x_1..x_{j-1}):

* accept x_j with probability min(1, p_j(x_j) / q_j(x_j)), in order; stop at the first rejection;
* on rejecting x_j, emit a token drawn from the residual normalise(max(0, p_j - q_j));
* when all d are accepted, emit a token drawn from p_{d+1} (the bonus token).

Every emitted token is then distributed exactly as the target's at that index (whatever q is):
P(emit t) = min(p(t), q(t)) + (1 - sum min(p, q)) * residual(t) = p(t). Draws come from the
`torch.Generator` passed in (one per worker), not from u(seed, n): the text for a request
without a seed is a sample of the right distribution, not a reproducible one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from services.worker.held_batch import HeldSeq
from shared.protocol.worker_channel import default_seed


@dataclass(frozen=True, slots=True)
class Drafts:
    """One row's proposal: its draft ids and, for a row that draws freely, q [d, V] float:
    the distribution each draft was drawn from (None: verified by the exact rule)."""

    token_ids: list[int]
    probs: Optional[torch.Tensor] = None


def draws_freely(seq: HeldSeq) -> bool:
    """Whether `seq` is a sampled request the client gave no seed: its drafts are verified by
    rejection sampling. The frontend pins default_seed(rid) on such a request, so a seed equal
    to it is taken as none (a client's own seed collides with it with odds 2**-32; then only
    the rule changes, both keep the target's distribution)."""
    seed = seq.sampling.seed
    return not seq.sampling.greedy and (seed is None or seed == default_seed(seq.rid))


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, draft_ids: list[int], generator: torch.Generator
) -> tuple[int, int]:
    """(drafts accepted `a`, the token emitted after them). `p` float [d + 1, V]: the target's
    probabilities at the d + 1 verified rows; `q` float [d, V]: the draft's, each row the one
    its draft was drawn from (so q_j(x_j) > 0); both rows sum to 1 (within rounding)."""
    d = len(draft_ids)
    if p.shape[0] != d + 1 or q.shape[0] != d:
        raise ValueError(f"{d} drafts need p [{d + 1}, V] and q [{d}, V], got "
                         f"{tuple(p.shape)} and {tuple(q.shape)}")  # fmt: skip
    u = torch.rand(d + 1, generator=generator, dtype=torch.float64).tolist()  # [0, 1)
    for j, x in enumerate(draft_ids):
        if u[j] * float(q[j, x]) >= float(p[j, x]):  # accept iff u < p(x) / q(x)
            return j, inverse_cdf(_residual(p[j], q[j]), u[d])
    return d, inverse_cdf(p[d], u[d])


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token a uniform u in [0, 1) picks from `probs` [V] (in vocabulary order; the
    weights need not sum to exactly 1)."""
    cdf = probs.cumsum(0)
    where = torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    return min(int(torch.searchsorted(cdf, where, right=True)), probs.shape[0] - 1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) [V] (inverse_cdf normalises); p itself where p <= q everywhere (then no
    draft is ever rejected but through rounding: p == q)."""
    r = (p - q).clamp_min_(0.0)
    return r if float(r.sum()) > 0.0 else p
