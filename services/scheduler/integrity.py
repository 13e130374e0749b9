"""The scheduler's invariants, checked by tests after every step (O(total blocks)).

* the block pool's own bookkeeping (services/scheduler/block_pool.py `check_integrity`): every
  block owned, free, cached or held, ref counts equal owners, nothing both cached and
  owned-free;
* a held block (a finished request's, its registration pending until `after_plan()`) is in
  the table of the finished request whose hold holds it, and those of its registered blocks
  still held hold what its keys claim (the pending registration continues them);
* a block is shared by several tables only with prefix caching on, and a table's registered
  blocks hold the content its request's keys claim (no request reads another prefix's KV);
* the `lpm` policy's remembered cached lengths: while no cached block was dropped since, the
  remembered prefix is still cached, and with no registration since either, it is exactly what
  a fresh lookup finds;
* only running requests hold blocks, and a waiting one has nothing computed or registered
  (what a lookup's `attach` of a miss relies on); running <= max_num_seqs; every live request
  is either waiting or running, exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.scheduler.policy import WaitingQueue
from services.scheduler.request import Request, RequestStatus
from services.scheduler.running import RunningSet

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler


def check_scheduler(
    sched: Scheduler, live: Iterable[Request], waiting: WaitingQueue, batch: RunningSet
) -> None:
    """Raise AssertionError if an invariant is broken."""
    bs = sched.block_size
    running = list(batch.requests.values())
    sched.pool.check_integrity(
        [r.block_ids for r in running], shared_ok=sched.config.enable_prefix_caching
    )
    for req in running:  # a table's registered blocks hold what its keys claim
        assert req.num_registered_blocks * bs <= req.num_computed_tokens
        for i in range(req.num_registered_blocks):
            key = sched.pool.key_of(req.block_ids[i])
            assert key in (None, req.block_keys[i]), f"{req.rid}: block {i} holds other KV"
    _check_held(sched)
    _check_lpm_memo(sched, waiting)
    assert len(batch) <= sched.config.max_num_seqs, "too many running"
    num_live = 0
    for req in live:
        num_live += 1
        if req.status is RequestStatus.WAITING:
            held = sched.is_held(req)  # set aside by bisection of a failed step (faults.py)
            assert not req.block_ids and (req in waiting) != held, f"{req.rid} waiting wrongly"
            # what a lookup's `attach` assumes of a request it starts (a miss changes nothing)
            assert req.num_computed_tokens == req.num_registered_blocks == 0, f"{req.rid} stale"
        else:
            assert req.status is RequestStatus.RUNNING and req.rid in batch, f"{req.rid} lost"
    for req in running:
        assert req.padding or sched.is_live(req.rid), f"{req.rid} runs but is not live"
        assert len(req.block_ids) * bs >= req.num_computed_tokens
    assert len(waiting) + sched.num_held + sum(not r.padding for r in running) == num_live, (
        "live requests are neither waiting nor running"
    )


def _check_held(sched: Scheduler) -> None:
    pool = sched.pool
    tables = sched.prefix_cache.held_tables()
    for block in range(pool.num_blocks):
        hold_id = pool.held_by(block)
        if hold_id is not None:
            assert block in tables.get(hold_id, ()), f"held block {block} is in no held table"
    for req, table, num_full, hold_id in sched.prefix_cache.pending_holds():
        assert req.num_registered_blocks <= num_full <= len(table)
        for i in range(req.num_registered_blocks):
            if pool.held_by(table[i]) == hold_id:  # else released (and maybe reused) since
                key = pool.key_of(table[i])
                assert key in (None, req.block_keys[i]), f"{req.rid}: block {i} holds other KV"


def _check_lpm_memo(sched: Scheduler, waiting: WaitingQueue) -> None:
    dropped, registered = sched.prefix_cache.version()
    for rid, ((was_dropped, was_registered), n) in waiting.known_cached_lens().items():
        req = waiting.find(rid)
        assert req is not None, f"lpm remembers {rid}, which does not wait"
        if was_dropped != dropped:
            continue  # stale: looked up afresh next time
        num_full = (len(req.token_ids) - 1) // sched.block_size
        found = sched.pool.num_prefix(req.block_keys, num_full) * sched.block_size
        assert n <= found, f"{rid}: lpm remembers {n} cached tokens, {found} are"
        if was_registered == registered:
            assert n == found, f"{rid}: lpm remembers {n} cached tokens, {found} are"
