"""The frontend's engines: one link per scheduler address (engine_link.py) and the router
(router.py) that picks one for each new request.

Owns which engines are ready and how many of this frontend's requests each one carries; the
request flow (request_flow.py) decides what an engine's loss means for its requests. Sends
never block: a link that cannot take a frame says so and the caller picks another or gives up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import zmq

from services.tokenizer.config import FrontendConfig
from services.tokenizer.engine_link import EngineLink
from services.tokenizer.pairing import pairing_fields, pairing_problem
from services.tokenizer.router import Router
from services.tokenizer.router_targets import LatencyReport, request_targets
from shared.protocol.codec import encode
from shared.protocol.engine_channel import (
    EngineNotReady,
    EngineReady,
    FrontendBye,
    SubmitRequest,
)


class Engines:
    """Create, `connect()`, register each link's `socket` and `watch.monitor` in the loop's
    poller. `on_gone(index)` is called when a scheduler's connection drops.

    Invariants (`check_invariants`): one link per scheduler address, link i at index i, and
    the router knows exactly these engines."""

    def __init__(
        self,
        config: FrontendConfig,
        context: zmq.Context,
        log: Any,
        on_gone: Callable[[int], None],
        identity: str,
    ) -> None:
        """`identity`: this process's socket identity towards every scheduler."""
        self._config = config
        self._log = log
        self.links: tuple[EngineLink, ...] = tuple(
            EngineLink(i, addr, config.frontend_id, identity, context, on_gone, config.curve_keys)
            for i, addr in enumerate(config.scheduler_addresses)
        )
        self._router = Router(config.router, len(self.links))

    def connect(self, now: float) -> None:
        """Called once at `open()`: every link connects; silence counts from `now`."""
        for link in self.links:
            link.connect(now)

    def close(self) -> None:
        """Called once when the loop ends."""
        for link in self.links:
            link.close()

    def name_of(self, engine: int) -> str:
        """An engine's name in logs and replies (its index as text)."""
        return self.links[engine].name

    @property
    def names(self) -> list[str]:
        """Each engine's name, in engine order."""
        return [link.name for link in self.links]

    # ---- requests --------------------------------------------------------------------------

    def submit(self, submit: SubmitRequest, exclude: Optional[int]) -> Optional[int]:
        """Send a request to the engine the router picks among the ready ones (not `exclude`);
        an engine whose send fails is skipped. The engine that took it (now counted as
        carrying it), or None when none did. With engine roles (docs/design/disaggregation.md)
        a new prompt goes to a prefill engine, asked to hand over, while a decode engine is
        ready; a request that has outputs (resumed, or handed over) to a decode engine."""
        ids = submit.prompt_token_ids
        ready = [link.index for link in self.links if link.ready and link.index != exclude]
        ready, submit = self.by_role(ready, submit)
        by_load = submit.kv_source is not None
        table = self.reference()  # the engines behind one frontend share one class table
        targets = None
        if table is not None:
            targets = request_targets(submit, table.slo_classes, table.slo_default_class)
        frame = encode(submit)
        while ready:
            engine = self._router.choose(ids, ready, by_load, targets)
            if engine is None:
                return None
            if self.links[engine].send(frame):
                self._router.routed(engine, ids)
                return engine
            ready.remove(engine)
        return None

    def by_role(self, ready: list[int], submit: SubmitRequest) -> tuple[list[int], SubmitRequest]:
        """The ready engines that suit `submit` (all of them when none of its role is ready)
        and the submit to send: `hand_over` set for a prefill engine (only those a ready
        decode engine pairs with: pairing.py); a handed-over request to a decode engine that
        pairs with its prefill engine, its `kv_source` dropped (recomputed) when none does."""
        roles = {e: self.role_of(e) for e in ready}
        prefill = [e for e in ready if roles[e] == "prefill"]
        decode = [e for e in ready if roles[e] != "prefill"]  # colocated ones decode too
        takers = [e for e in ready if roles[e] == "decode"]
        if submit.kv_source is not None:
            source = self._serving(submit.kv_source.kv_endpoint)
            takers = [e for e in takers if source is None or self.pairs(source, e)]
            if takers:
                return takers, submit
            submit = dataclasses.replace(submit, kv_source=None)  # nobody can pull it
        if not prefill or not decode:
            return ready, submit
        if submit.output_token_ids:
            return decode, submit
        prefill = [p for p in prefill if any(self.pairs(p, d) for d in takers)]
        if not prefill:
            return ready, submit  # no decode engine takes a hand-over: served colocated
        return prefill, dataclasses.replace(submit, hand_over=True)

    def pairs(self, prefill: int, decode: int) -> bool:
        """Whether engine `decode` can take engine `prefill`'s hand-overs (both ready)."""
        p, d = self.links[prefill].ready, self.links[decode].ready
        return p is not None and d is not None and pairing_problem(p, d) is None

    def _serving(self, kv_endpoint: str) -> Optional[int]:
        """The ready engine whose worker serves KV at `kv_endpoint`, if any."""
        return next((link.index for link in self.links if link.ready is not None
                     and link.ready.kv_endpoint == kv_endpoint), None)  # fmt: skip

    def _log_pairings(self, link: EngineLink) -> None:
        """Engine `link` became ready: how it pairs with each ready engine of the other role
        (a prefill and a decode engine), logged once now, not at the first hand-over."""
        mine = link.ready
        if mine is None or mine.role not in ("prefill", "decode"):
            return
        for other in self.links:
            theirs = other.ready
            if theirs is None or {mine.role, theirs.role} != {"prefill", "decode"}:
                continue
            pair = (link, other) if mine.role == "prefill" else (other, link)
            p, d = (pair[0].ready, pair[1].ready)
            assert p is not None and d is not None
            names = {"prefill": pair[0].name, "decode": pair[1].name, **pairing_fields(p, d)}
            problem = pairing_problem(p, d)
            if problem is None:
                self._log.info("handover_pairing", **names)
            else:
                self._log.error("handover_pairing_refused", reason=problem, **names)

    def role_of(self, engine: int) -> str:
        """An engine's role as it last said (EngineReady); "colocated" before it did."""
        ready = self.links[engine].ready
        return ready.role if ready is not None else "colocated"

    def kv_endpoint_of(self, engine: int) -> str:
        """Where a prefill engine's worker serves leased KV ("" when unknown)."""
        ready = self.links[engine].ready
        return ready.kv_endpoint if ready is not None else ""

    def release(self, engine: Optional[int]) -> None:
        """One of this frontend's requests left `engine` (it ended, or moved elsewhere; None:
        it was waiting for an engine)."""
        if engine is not None:
            self._router.request_done(engine)

    def num_carried(self, engine: int) -> int:
        """This frontend's requests that `engine` carries now (submitted, not released)."""
        return self._router.loads[engine].num_local

    def send(self, engine: int, msg: Any) -> bool:
        """One message to one engine; False when it could not take it."""
        return self.links[engine].send(encode(msg))

    def send_all(self, msg: Any) -> list[int]:
        """One message to every engine; the engines that took it."""
        frame = encode(msg)
        return [link.index for link in self.links if link.send(frame)]

    def say_bye(self) -> None:
        """Called last when the frontend stops: each scheduler drops this frontend at once."""
        self.send_all(FrontendBye(self._config.frontend_id))

    # ---- readiness -------------------------------------------------------------------------

    def reference(self) -> Optional[EngineReady]:
        """A ready engine's handshake (the first): the model's limits for admission. Engines
        behind one frontend serve the same model."""
        return next((link.ready for link in self.links if link.ready is not None), None)

    def not_ready_reason(self) -> str:
        """Why the frontend takes no request when no engine is ready: the first engine's."""
        return self.links[0].not_ready_reason

    @property
    def num_ready(self) -> int:
        """Engines taking requests now (`stats`)."""
        return sum(link.ready is not None for link in self.links)

    def on_ready(self, link: EngineLink, msg: EngineReady) -> None:
        """EngineReady (the answer to each hello): the engine takes requests; its load report
        and whether every ready engine caches prefixes go to the router."""
        if link.mark_ready(msg):
            self._log.info(
                "engine_ready", engine=link.name, address=link.address, model=msg.model_name,
                max_model_len=msg.max_model_len, vocab_size=msg.vocab_size, role=msg.role,
                tensor_parallel_size=msg.tensor_parallel_size,
            )  # fmt: skip
            self._log_pairings(link)
        latency = LatencyReport(msg.slo_queue_s, msg.slo_admission_rate, msg.slo_decode_step_s,
                                msg.slo_prefill_tokens_per_s)  # fmt: skip
        self._router.on_report(link.index, msg.num_waiting, msg.num_running, msg.kv_usage, latency)
        self._router.set_prefix_caching(
            all(e.ready.prefix_caching for e in self.links if e.ready is not None)
        )

    def on_not_ready(self, link: EngineLink, msg: EngineNotReady) -> None:
        """EngineNotReady: new requests go elsewhere until the worker is back (those in flight
        stay: the scheduler restarts them by recompute, or ends them itself: worker_failed),
        or, when it is draining, until it says ready again (the request flow moves those in
        flight)."""
        if link.mark_not_ready(msg.reason):
            self._log.warning("engine_not_ready", engine=link.name, reason=msg.reason)

    def index_of(self, name: str) -> Optional[int]:
        """The engine called `name` (its index as text), if there is one."""
        return next((link.index for link in self.links if link.name == name), None)

    def mark_lost(self, engine: int, reason: str, message: str, num_in_flight: int) -> bool:
        """Take a lost engine out of rotation (its cache picture goes with it). False when it
        was out already for this reason with nothing in flight: the silence check repeats
        every tick, and a repeat changes nothing."""
        link = self.links[engine]
        if link.ready is None and not num_in_flight and link.not_ready_reason == reason:
            return False
        if link.ready is not None or num_in_flight:
            self._log.warning("engine_lost", engine=link.name, reason=reason, detail=message,
                              num_in_flight=num_in_flight)  # fmt: skip
        link.mark_lost(reason)
        self._router.engine_lost(engine)
        return True

    def health(self) -> list[dict[str, Any]]:
        """Each engine in the `health` reply: its link's state and the router's load figures."""
        loads = self._router.loads
        return [link.health(loads[i].estimate(), loads[i].kv_usage)
                for i, link in enumerate(self.links)]  # fmt: skip

    def check_invariants(self) -> None:
        """Read-only; raises AssertionError when the links and the router disagree. (That the
        router's counts match the open requests is the request flow's invariant.)"""
        assert len(self.links) == len(self._config.scheduler_addresses) > 0
        assert len(self._router.loads) == len(self.links)
        for i, link in enumerate(self.links):
            assert link.index == i and link.address == self._config.scheduler_addresses[i]
            link.check_invariants()
        self._router.check_invariants()
