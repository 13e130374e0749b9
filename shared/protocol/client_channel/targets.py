"""Latency targets a client may attach to a `generate` (docs/protocol.md, "Latency targets").

`ttft_ms` (time to first token) and `tpot_ms` (time per output token after the first), in
milliseconds; `slo_class`, a class of targets the engine is configured with (its explicit
targets win over the class's); `on_slo_miss`, what the engine does when it predicts, on arrival,
that the targets are out of reach: "reject" (refused at once with `slo_unattainable`) or
"best_effort" (served after the requests that can still make theirs). Only `--policy slo` acts
on them; the other policies carry them and ignore them.
"""

from __future__ import annotations

import math
from typing import Any

from shared.protocol.client_channel.messages import (
    NO_TARGETS,
    ClientMessageError,
    LatencyTargets,
)
from shared.protocol.engine_channel import ON_SLO_MISS
from shared.protocol.errors import ErrorCode, short_repr

# A TTFT is predicted reachable within this share of its target: room for the path the
# prediction does not see (frontend, tokenizer, the stream's first chunk) and for the
# admission rate's noise. At 1.0 the simulated H200 at 2x load admitted to the edge and 17%
# of the admitted missed (TTFT p99 2.3 s for 2 s; docs/lab/2026-12-slo.md). The engine's slo
# policy admits by it; the router prefers the engines that would admit by it.
TTFT_HEADROOM = 0.8
MAX_CLASS_NAME_CHARS = 64


def latency_targets(wire: dict[str, Any], rid: str) -> LatencyTargets:
    """The targets of a `generate` map; ClientMessageError naming the first bad field."""
    out: dict[str, Any] = {}
    for name in ("ttft_ms", "tpot_ms"):
        value = wire.get(name)
        if value is None:
            continue
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            msg = f"`{name}` must be a positive number of milliseconds, not {short_repr(value)}"
            raise ClientMessageError(ErrorCode.INVALID_PARAMS, msg, rid)
        out[name] = float(value)
    miss = wire.get("on_slo_miss")
    if miss is not None and miss not in ON_SLO_MISS:
        msg = f"`on_slo_miss` must be one of {', '.join(ON_SLO_MISS)}, not {short_repr(miss)}"
        raise ClientMessageError(ErrorCode.INVALID_PARAMS, msg, rid)
    name = wire.get("slo_class")
    if name is not None and (type(name) is not str or not 0 < len(name) <= MAX_CLASS_NAME_CHARS):
        msg = f"`slo_class` must be a name of 1-{MAX_CLASS_NAME_CHARS} characters"
        raise ClientMessageError(ErrorCode.INVALID_FIELD, msg, rid)
    if not out and miss is None and name is None:
        return NO_TARGETS
    return LatencyTargets(slo_class=name, on_slo_miss=miss, **out)
