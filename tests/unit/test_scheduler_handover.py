"""A KV hand-over in the scheduler core (docs/design/disaggregation.md), prefill engine and
decode engine as two schedulers with their checking workers (tokens depend only on the rid and
the output index; every context read is checked against the KV its blocks hold), and
`check_invariants()` after every step:

* the prefill side ends the request "handover" after its first token, its full blocks leased
  (owned until released or expired); the decode side, its blocks filled with the prefill
  worker's KV, starts from them as a prefix-cache hit and goes on exactly as the undisturbed
  request; releasing the lease frees the blocks;
* a failed pull, and a worker lost during a pull, recompute instead, with the same tokens;
* a tensor-parallel decode worker's pull is admitted once every rank answered (one failed:
  recomputed);
* an unreleased lease expires after `lease_timeout_s` (renewed: later) and its blocks are
  free again.
"""

from __future__ import annotations

import dataclasses

from test_scheduler_support import CheckingWorker, FakeClock, drive, make, submit

from services.scheduler.scheduler import Scheduler
from services.scheduler.summary import summarize
from shared.protocol.engine_channel import SubmitRequest
from shared.protocol.kv_channel import KvHandover
from shared.protocol.worker_channel import EndLease, GrantLease, KvPulled, PullKv

PROMPT_LEN, MAX_TOKENS, BS = 41, 6, 4  # 10 full blocks of 4 prompt tokens, one token after


def undisturbed() -> list[int]:
    sched, worker, clock = make()
    sched.add_request(submit("r", PROMPT_LEN, MAX_TOKENS))
    return drive(sched, worker, clock).tokens("r")


def prefill() -> tuple[Scheduler, CheckingWorker, FakeClock, KvHandover]:
    """The prefill engine after the request's hand-over, and the lease's reference."""
    sched, worker, clock = make(lease_timeout_s=3.0)
    sched.add_request(dataclasses.replace(submit("r", PROMPT_LEN, MAX_TOKENS), hand_over=True))
    run = drive(sched, worker, clock)
    final = run.final("r")
    assert final.finish_reason == "handover" and final.handover is not None
    assert run.tokens("r") == undisturbed()[:1]
    return sched, worker, clock, final.handover


def decode_submit(first: list[int], ref: KvHandover) -> SubmitRequest:
    source = dataclasses.replace(ref, kv_endpoint="ipc://prefill-kv")
    return dataclasses.replace(submit("r", PROMPT_LEN, MAX_TOKENS), output_token_ids=first,
                               attempt=1, kv_source=source)  # fmt: skip


def copy_kv(src: CheckingWorker, src_blocks: list[int], dst: CheckingWorker,
            dst_blocks: list[int]) -> None:  # fmt: skip
    """What the decode worker's pull does: the prefill worker's blocks into its own."""
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        dst.kv[d * BS : (d + 1) * BS] = src.kv[s * BS : (s + 1) * BS]


def test_the_prompt_kv_moves_and_the_request_goes_on_as_undisturbed() -> None:
    whole = undisturbed()
    pre, pre_worker, _, ref = prefill()
    assert len(ref.block_ids) == PROMPT_LEN // BS and ref.num_tokens == 40
    (grant,) = pre.take_worker_messages()
    assert isinstance(grant, GrantLease) and grant.block_ids == ref.block_ids
    assert pre.stats()["num_leases"] == 1 and pre.pool.num_used == len(ref.block_ids)
    dec, dec_worker, dec_clock = make()
    assert dec.add_request(decode_submit(whole[:1], ref)) is None
    (pull,) = dec.take_worker_messages()
    assert isinstance(pull, PullKv) and pull.source.lease_id == ref.lease_id
    assert not dec.has_work() and dec.is_live("r")  # pulling: in no queue yet
    copy_kv(pre_worker, ref.block_ids, dec_worker, pull.block_ids)
    dec.pull_done(KvPulled("r", True, 1234, 0.001))
    run = drive(dec, dec_worker, dec_clock)
    assert run.tokens("r") == whole[1:]
    assert run.plans[0].start_positions == [40], "the pulled blocks were not a prefix hit"
    (done,) = dec.pulls.take_done()
    assert done.ok and done.num_bytes == 1234
    assert dec.pool.num_used == 0
    assert pre.leases.release(ref.lease_id, ref.generation)
    assert not pre.leases.release(ref.lease_id, ref.generation), "released twice"
    assert pre.take_worker_messages() == [EndLease(ref.lease_id)]
    assert pre.pool.num_used == 0 and pre.stats()["num_leases_released"] == 1
    pre.check_invariants()


def test_a_failed_pull_and_a_lost_worker_recompute_the_same_tokens() -> None:
    whole = undisturbed()
    _, _, _, ref = prefill()
    for lose_worker in (False, True):
        dec, dec_worker, dec_clock = make()
        dec.add_request(decode_submit(whole[:1], ref))
        if lose_worker:
            assert dec.requeue_all(3, "worker_failed", "lost") == []
        else:
            dec.pull_done(KvPulled("r", False, code="lease_unknown"))
        (done,) = dec.pulls.take_done()
        assert not done.ok and done.code == ("worker_lost" if lose_worker else "lease_unknown")
        run = drive(dec, dec_worker, dec_clock)
        assert run.tokens("r") == whole[1:]
        assert run.plans[0].start_positions == [0]  # recomputed: nothing was pulled
        assert dec.pool.num_used == 0


def test_a_tensor_parallel_pull_is_admitted_once_every_rank_answered() -> None:
    """Two decode ranks pull their own shard each: one rank's answer admits nothing (the other
    may still be writing its shard into the blocks); both ok: the pulled blocks are a prefix hit
    (bytes summed, the slower rank's seconds); one failed: the request recomputes."""
    whole = undisturbed()
    pre, pre_worker, _, ref = prefill()
    for second_ok in (True, False):
        dec, dec_worker, dec_clock = make()
        dec.add_request(decode_submit(whole[:1], ref))
        (pull,) = dec.take_worker_messages()
        copy_kv(pre_worker, ref.block_ids, dec_worker, pull.block_ids)
        dec.pull_done(KvPulled("r", True, 1000, 0.002, rank=1, world_size=2))
        assert not dec.has_work() and dec.is_live("r") and dec.pulls.take_done() == []
        last = KvPulled("r", second_ok, 1000, 0.001, code="" if second_ok else "timeout",
                        rank=0, world_size=2)  # fmt: skip
        dec.pull_done(last)
        (done,) = dec.pulls.take_done()
        assert (done.ok, done.code) == ((True, "") if second_ok else (False, "timeout"))
        if second_ok:
            assert done.num_bytes == 2000 and done.seconds == 0.002
        run = drive(dec, dec_worker, dec_clock)
        assert run.tokens("r") == whole[1:]
        assert run.plans[0].start_positions == [40 if second_ok else 0]
        assert dec.pool.num_used == 0
        dec.check_invariants()


def test_an_aborted_pull_admits_nothing_and_frees_its_blocks() -> None:
    _, _, _, ref = prefill()
    dec, _, _ = make()
    dec.add_request(decode_submit([5], ref))
    out = dec.abort_request("r")
    assert out is not None and out.finish_reason == "abort"
    assert dec.abort_request("r") is None  # idempotent
    dec.pull_done(KvPulled("r", True, 1, 0.001))
    assert not dec.is_live("r") and not dec.has_work() and dec.pool.num_used == 0
    dec.check_invariants()


def test_an_unreleased_lease_expires_and_its_blocks_are_free() -> None:
    """Renewed (the frontend's heartbeat) it lasts another time-out; then it expires."""
    pre, _, clock, ref = prefill()
    pre.take_worker_messages()
    clock.advance(2.9)
    assert pre.leases.expire() == 0 and pre.leases.renew([ref.lease_id, 999]) == 1
    clock.advance(2.9)
    assert pre.leases.expire() == 0 and pre.pool.num_used == len(ref.block_ids)
    clock.advance(0.2)
    assert pre.leases.expire() == 1
    assert pre.take_worker_messages() == [EndLease(ref.lease_id)]
    assert pre.pool.num_used == 0 and not pre.leases.release(ref.lease_id, ref.generation)
    pre.check_invariants()


def test_the_engine_summary_reports_the_transfer() -> None:
    before = {"num_kv_pulls": 2, "kv_pull_bytes": 1 << 20, "kv_pull_seconds": 0.5}
    after = {"num_kv_pulls": 6, "kv_pull_bytes": 5 << 20, "kv_pull_seconds": 0.504}
    out = summarize(before, after, 5.0, [])
    assert out["num_kv_pulls"] == 4 and out["kv_pull_mib"] == 4.0
    assert out["kv_pull_gb_per_s"] == round((4 << 20) / 0.004 / 1e9, 2)
    leases = summarize(
        {"num_leases_granted": 1}, {"num_leases_granted": 4, "num_leases": 1}, 5.0, []
    )
    assert leases["num_leases_granted"] == 3 and leases["num_leases_held"] == 1
    assert "num_kv_pulls" not in summarize({}, {}, 5.0, [])
