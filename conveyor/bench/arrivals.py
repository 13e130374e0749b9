"""When each request is sent: burst, Poisson, or gamma with a burstiness factor.

Inter-arrival gaps are drawn from a gamma distribution with shape `burstiness` and mean
1 / rate, as `vllm bench serve` does: burstiness 1 is a Poisson process (exponential gaps), < 1
is burstier (clumps and long pauses, coefficient of variation 1/sqrt(burstiness)), > 1 is more
regular. An infinite rate sends everything at once (burst). A separate cap, max concurrency,
limits how many requests are in flight; it is enforced by the runner, not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True, slots=True)
class ArrivalConfig:
    """request_rate in requests/s (math.inf = burst); num_warmups requests are sent first, one
    at a time, and not counted."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: Optional[int] = None
    num_warmups: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf for a burst), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")

    @property
    def kind(self) -> str:
        if math.isinf(self.request_rate):
            return "burst"
        return "poisson" if self.burstiness == 1.0 else "gamma"


def arrival_offsets(cfg: ArrivalConfig, num_requests: int) -> list[float]:
    """Seconds after the start at which each request is sent; non-decreasing, first one at 0."""
    if num_requests < 1:
        return []
    if math.isinf(cfg.request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(cfg.seed)
    theta = 1.0 / (cfg.request_rate * cfg.burstiness)  # scale: mean gap = shape * theta = 1/rate
    gaps = rng.gamma(shape=cfg.burstiness, scale=theta, size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
