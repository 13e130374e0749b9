"""The scheduler's side of a KV hand-over between engines (docs/design/disaggregation.md).

* `Leases` (a prefill engine): a request that finished "handover" leaves its full blocks under a
  lease (its own reference on each block) until the frontend releases it or it times out. The
  worker hears `GrantLease` before the hand-over reaches any frontend, and `EndLease` before
  any plan that may reuse the blocks (the loop sends `take_worker_messages()` before it plans).
* `Pulls` (a decode engine): a request submitted with `kv_source` waits here, off the queue,
  while its worker pulls the KV into blocks allocated to the pull; then the blocks join the
  prefix cache and the request is admitted as the resumption it is (the pulled blocks are its
  prefix-cache hit). A pull that fails, or cannot start, admits it to recompute instead.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from services.scheduler.block_pool import BlockPool
from services.scheduler.prefix_cache import PrefixCache
from services.scheduler.request import Request
from services.scheduler.slo_policy import ArrivalDecision
from shared.prefix_hash import extend_int_block_keys
from shared.protocol.engine_channel import HandoverDone, SubmitRequest
from shared.protocol.kv_channel import KvHandover
from shared.protocol.worker_channel import EndLease, GrantLease, KvPulled, PullKv


@dataclass(slots=True)
class _Lease:
    generation: int
    block_ids: list[int]
    deadline: float  # scheduler clock


class Leases:
    """Owns the leased blocks' references. Invariant: every leased block is owned (its
    reference counted in the pool) and no lease outlives its deadline past `expire`."""

    def __init__(self, pool: BlockPool, timeout_s: float, clock: Callable[[], float]) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._clock = clock
        self._leases: dict[int, _Lease] = {}
        self._next_id = 1
        self.worker_messages: list[Any] = []  # GrantLease / EndLease, sent by the loop
        self.num_granted = self.num_released = self.num_expired = 0

    def grant(self, req: Request) -> KvHandover:
        """`req` finished "handover" (called before its blocks are dropped): its full computed
        blocks stay owned under a new lease. The reference the frontend passes on."""
        bs = self._pool.block_size
        blocks = list(req.block_ids[: req.num_computed_tokens // bs])
        lease_id, generation = self._next_id, secrets.randbits(63)
        self._next_id += 1
        self._pool.share(blocks)
        self._leases[lease_id] = _Lease(generation, blocks, self._clock() + self._timeout_s)
        self.worker_messages.append(GrantLease(lease_id, generation, blocks))
        self.num_granted += 1
        return KvHandover(lease_id, generation, blocks, len(blocks) * bs, bs)

    def release(self, lease_id: int, generation: int) -> bool:
        """The frontend's ReleaseLease: the blocks are freed (cached when registered). False
        for an unknown lease or another generation (expired already: a no-op)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.generation != generation:
            return False
        self._end(lease_id)
        self.num_released += 1
        return True

    def renew(self, lease_ids: list[int]) -> int:
        """The frontend's RenewLeases: each held one lasts another time-out from now. How
        many were held."""
        deadline = self._clock() + self._timeout_s
        held = [self._leases[i] for i in lease_ids if i in self._leases]
        for lease in held:
            lease.deadline = deadline
        return len(held)

    def expire(self) -> int:
        """Housekeeping: leases past their deadline end. How many did."""
        now = self._clock()
        late = [i for i, lease in self._leases.items() if lease.deadline < now]
        for lease_id in late:
            self._end(lease_id)
        self.num_expired += len(late)
        return len(late)

    def _end(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        self.worker_messages.append(EndLease(lease_id))  # sent before the next plan
        self._pool.free(lease.block_ids)

    def take_messages(self) -> list[Any]:
        """GrantLease / EndLease for the worker, in order; the loop sends them before the next
        plan."""
        out, self.worker_messages = self.worker_messages, []
        return out

    def tables(self) -> list[list[int]]:
        """Each lease's blocks (the pool's invariant counts their references)."""
        return [lease.block_ids for lease in self._leases.values()]

    def stats(self) -> dict[str, float]:
        return {"num_leases": len(self._leases), "num_leases_granted": self.num_granted,
                "num_leases_released": self.num_released,
                "num_leases_expired": self.num_expired}  # fmt: skip


@dataclass(slots=True)
class _Pull:
    submit: SubmitRequest
    block_ids: list[int]
    decision: Optional[ArrivalDecision]  # its targets, decided on arrival, kept for admission
    cancelled: bool = False
    answers: dict[int, KvPulled] = dataclasses.field(default_factory=dict)  # rank -> its answer


# A request to admit once its pull ends, with the targets decided on its arrival (a hand-over
# is a resumption: never refused, and it keeps the SLO targets its client gave)
Admission = tuple[SubmitRequest, Optional[ArrivalDecision]]


class Pulls:
    """Owns the requests whose KV is being pulled and the blocks allocated to them. Invariant:
    a pulling request is in no queue and not live; its blocks are owned by the pull alone."""

    def __init__(self, pool: BlockPool, cache: PrefixCache) -> None:
        self._pool = pool
        self._cache = cache
        self._pending: dict[str, _Pull] = {}
        self.worker_messages: list[Any] = []  # PullKv, sent by the loop
        self.done: list[HandoverDone] = []  # for the requests' frontends
        self.num_pulled = self.num_failed = self.num_bytes = 0
        self.num_skipped: dict[str, int] = {}  # why a hand-over was recomputed, not pulled
        self.seconds = 0.0

    def __contains__(self, rid: str) -> bool:
        return rid in self._pending

    def start(self, req: SubmitRequest, decision: Optional[ArrivalDecision] = None) -> bool:
        """A submit with `kv_source`: True when its pull started (it waits here with its
        arrival `decision`, admitted with it when the pull ends); False when it cannot (no
        prefix cache to hand the blocks to, another block size, no free blocks): the caller
        admits it to recompute, and the lease is released."""
        src = req.kv_source
        assert src is not None
        num = len(src.block_ids)
        pool = self._pool
        skip = None
        if not self._cache.enabled or src.block_size != pool.block_size or not src.kv_endpoint:
            skip = "unusable"  # no prefix cache to hand the blocks to, or another layout
        elif num == 0:
            skip = "short"  # a prompt shorter than a block: nothing worth pulling
        elif not pool.can_allocate(num, keep_watermark=True):
            skip = "no_blocks"
        blocks = pool.allocate(num) if skip is None else None
        if blocks is None:
            skip = skip or "no_blocks"
            self.num_skipped[skip] = self.num_skipped.get(skip, 0) + 1
            self.done.append(HandoverDone(req.rid, src, False, code=skip))
            return False
        self._pending[req.rid] = _Pull(req, blocks, decision)
        self.worker_messages.append(PullKv(req.rid, src, blocks))
        return True

    def cancel(self, rid: str) -> bool:
        """An abort of a pulling request: it is not admitted when its pull ends (the worker
        may be writing its blocks: they are freed then). False when it is not pulling."""
        pull = self._pending.get(rid)
        if pull is None or pull.cancelled:
            return False
        pull.cancelled = True
        return True

    def finish(self, msg: KvPulled) -> Optional[Admission]:
        """A rank's KvPulled: the request to admit now and its arrival decision (None:
        unknown, cancelled, or other ranks of a tensor-parallel worker still pulling their
        shards: its blocks are written only when every rank has answered). On success its
        pulled blocks are registered in the prefix cache before they are freed."""
        pull = self._pending.get(msg.rid)
        if pull is None:
            return None
        pull.answers[msg.rank] = msg
        if len(pull.answers) < msg.world_size:
            return None
        del self._pending[msg.rid]
        msg = _joined(msg.rid, list(pull.answers.values()))
        src = pull.submit.kv_source
        assert src is not None
        if msg.ok:
            keys: list[int] = []
            num = len(pull.block_ids)
            tokens = pull.submit.prompt_token_ids
            extend_int_block_keys(keys, tokens, self._pool.block_size, self._cache.namespace, num)
            self._pool.register_blocks(pull.block_ids, keys, 0, num)
            self.num_pulled += 1
            self.num_bytes += msg.num_bytes
            self.seconds += msg.seconds
        else:
            self.num_failed += 1
        self._pool.free(pull.block_ids)
        done = HandoverDone(msg.rid, src, msg.ok, msg.num_bytes, msg.seconds, msg.code)
        self.done.append(done)
        if pull.cancelled:
            return None
        return dataclasses.replace(pull.submit, kv_source=None), pull.decision

    def drop_all(self) -> list[Admission]:
        """The worker was lost (its pool with it): every pull failed; the requests to admit
        (to recompute), with their arrival decisions. Their blocks belong to the old pool: not
        freed."""
        out = []
        for pull in self._pending.values():
            src = pull.submit.kv_source
            assert src is not None
            self.done.append(HandoverDone(pull.submit.rid, src, False, code="worker_lost"))
            self.num_failed += 1
            if not pull.cancelled:
                out.append((dataclasses.replace(pull.submit, kv_source=None), pull.decision))
        self._pending.clear()
        return out

    def take_messages(self) -> list[Any]:
        """PullKv for the worker, in order (sent before the next plan)."""
        out, self.worker_messages = self.worker_messages, []
        return out

    def keep_done(self, done: list[HandoverDone]) -> None:
        """Ended pulls an earlier Pulls had not yet handed out (the core started afresh)."""
        self.done.extend(done)

    def take_done(self) -> list[HandoverDone]:
        """Pulls that ended, each for its request's frontend (which releases the lease)."""
        out, self.done = self.done, []
        return out

    def tables(self) -> list[list[int]]:
        return [pull.block_ids for pull in self._pending.values()]

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {
            "num_kv_pulling": len(self._pending), "num_kv_pulls": self.num_pulled,
            "num_kv_pull_failures": self.num_failed, "kv_pull_bytes": self.num_bytes,
            "kv_pull_seconds": self.seconds,
        }  # fmt: skip
        out.update({f"num_kv_pulls_skipped_{k}": v for k, v in self.num_skipped.items()})
        return out


def _joined(rid: str, answers: list[KvPulled]) -> KvPulled:
    """The ranks' answers to one pull as one: ok when every rank's shard landed (its bytes
    summed, the slowest rank's seconds), else the first failure's code (the request
    recomputes; a shard alone is no KV)."""
    failed = [a for a in answers if not a.ok]
    if failed:
        return KvPulled(rid, False, code=failed[0].code, message=failed[0].message)
    return KvPulled(rid, True, sum(a.num_bytes for a in answers), max(a.seconds for a in answers))
