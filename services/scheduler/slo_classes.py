"""Named classes of latency targets, configured on the engine (`--slo-classes`), and how a
request's own targets combine with them (docs/protocol.md, "Latency targets").

The flag's text is `name:key=value,...;name:...` with keys `ttft_ms`, `tpot_ms` and
`on_slo_miss`, e.g. the default `interactive:ttft_ms=2000,tpot_ms=50;batch:ttft_ms=30000,
tpot_ms=200`. A request names a class (`slo_class`) or gives targets itself, or both (its own
targets win); one naming neither gets `--slo-default-class`'s targets, or none. Only `--policy
slo` acts on targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from shared.protocol.engine_channel import ON_SLO_MISS, ClassTargets, SubmitRequest, target_problem

# What a request that does not say gets: served late rather than refused, the choice that
# changes nothing for a client unaware of targets.
DEFAULT_ON_SLO_MISS = "best_effort"
DEFAULT_SLO_CLASSES = "interactive:ttft_ms=2000,tpot_ms=50;batch:ttft_ms=30000,tpot_ms=200"


@dataclass(frozen=True, slots=True)
class SloTargets:
    """One class's targets (or a request's, resolved); a None target is no target."""

    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    on_slo_miss: str = DEFAULT_ON_SLO_MISS

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            problem = target_problem(name, getattr(self, name))
            if problem is not None:
                raise ValueError(problem)
        if self.on_slo_miss not in ON_SLO_MISS:
            raise ValueError(f"on_slo_miss must be one of {', '.join(ON_SLO_MISS)}")

    @property
    def has_targets(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


NO_TARGETS = SloTargets()


def parse_slo_classes(text: str) -> dict[str, SloTargets]:
    """The classes of `--slo-classes`; ValueError naming the first problem."""
    classes: dict[str, SloTargets] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, spec = part.partition(":")
        name = name.strip()
        if not sep or not name or name in classes:
            raise ValueError(f"slo class {part!r}: want a new name:key=value,...")
        fields: dict[str, object] = {}
        for item in filter(None, (i.strip() for i in spec.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key not in ("ttft_ms", "tpot_ms", "on_slo_miss"):
                raise ValueError(f"slo class {name!r}: unknown setting {item!r}")
            try:
                fields[key] = value if key == "on_slo_miss" else float(value)
            except ValueError:
                raise ValueError(f"slo class {name!r}: {key} is not a number") from None
        classes[name] = SloTargets(**fields)  # type: ignore[arg-type]
    return classes


def resolve_targets(
    req: SubmitRequest, classes: dict[str, SloTargets], default_class: Optional[str]
) -> Optional[SloTargets]:
    """The request's targets (its own over its class's over the default class's); None when it
    names a class the engine does not know (refused with invalid_params)."""
    name = req.slo_class if req.slo_class is not None else default_class
    base = NO_TARGETS if name is None else classes.get(name)
    if base is None:
        return None
    return SloTargets(
        ttft_ms=req.ttft_ms if req.ttft_ms is not None else base.ttft_ms,
        tpot_ms=req.tpot_ms if req.tpot_ms is not None else base.tpot_ms,
        on_slo_miss=req.on_slo_miss if req.on_slo_miss is not None else base.on_slo_miss,
    )


def reported_classes(classes: dict[str, SloTargets]) -> dict[str, ClassTargets]:
    """The classes as the engine reports them to its frontends (EngineReady, each heartbeat):
    a frontend routes a request naming a class by that class's targets."""
    return {name: ClassTargets(t.ttft_ms, t.tpot_ms) for name, t in classes.items()}
