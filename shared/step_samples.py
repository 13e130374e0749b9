"""The steps the online step-time predictor (shared/step_cost.py) fits: the last `window` steps,
and beside them a small reservoir of steps that span the range of every feature seen so far.

Why: the recent window alone can leave a term of the model unidentified. Under `--policy slo`
at 2x load on the simulated 70B the TPOT cap makes every step the same size (the budget that
fits 45 ms: ~190 tokens); once the window held only those, tokens were a constant, collinear
with the fixed overheads, so the fit could give a token's time to the overheads: in a long run
a 2,048-token step was predicted at 45 ms and took 457 ms (the cap then let such steps in).
Likewise a window of chunked steps alone splits the weights' read between the fixed and the
multi-token memory terms (decodes predicted at half their time, replaying that run's log). The
steps that tell the terms apart (early uncapped chunks, one-row and decode-only steps) had left
the window. So for each feature that scales a term (rows, tokens, samples, attention pairs, KV
tokens, a chunk in the step) the reservoir keeps the newest RESERVOIR_PER_BUCKET steps in each
power-of-two bucket of its value (256-511 tokens, 512-1,023, ...): the extremes and the sizes
between them (which tell a linear term from a quadratic one: tokens from attention pairs).
Those no longer in the window join the fit: ~30-40 steps beside the window's 512 on the 70B at
2x (at most 6 keys x 40 buckets x 2), so a fit's work (one starting split per scheduler step)
grows by a few %.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

# a step's shape (shared/step_cost.py `StepShape`; not imported: that module imports this one),
# read only through the attributes named in RESERVOIR_KEYS
Shape = TypeVar("Shape")

RESERVOIR_KEYS = (
    "num_rows", "num_tokens", "num_sampled", "attention_pairs", "kv_tokens", "has_chunk"
)  # fmt: skip
RESERVOIR_PER_BUCKET = 2


class StepSamples(Generic[Shape]):
    """The predictor's samples: `add` each step, `samples` for a fit. O(keys) a step."""

    def __init__(self, window: int, per_bucket: int = RESERVOIR_PER_BUCKET) -> None:
        self._recent: deque[tuple[int, Shape, float]] = deque(maxlen=window)
        self._per_bucket = per_bucket
        # (key, bit length of its value) -> the newest steps there: (step number, shape, seconds)
        self._buckets: dict[tuple[str, int], deque[tuple[int, Shape, float]]] = {}
        self._num_added = 0

    def add(self, shape: Shape, seconds: float) -> None:
        entry = (self._num_added, shape, seconds)
        self._num_added += 1
        self._recent.append(entry)
        for key in RESERVOIR_KEYS:
            bucket = (key, int(getattr(shape, key)).bit_length())
            kept = self._buckets.get(bucket)
            if kept is None:
                kept = self._buckets[bucket] = deque(maxlen=self._per_bucket)
            kept.append(entry)

    def samples(self) -> tuple[list[Shape], list[float]]:
        """The window's steps, then the reservoir's that left it (each step once)."""
        shapes = [shape for _, shape, _ in self._recent]
        seconds = [s for _, _, s in self._recent]
        oldest = self._recent[0][0] if self._recent else self._num_added
        older = {e[0]: e for kept in self._buckets.values() for e in kept if e[0] < oldest}
        for number in sorted(older):
            shapes.append(older[number][1])
            seconds.append(older[number][2])
        return shapes, seconds
