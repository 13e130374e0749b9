"""A hand-made worker and a driver for the scheduler tests (plus tests of the worker itself).

`CheckingWorker` plays the worker's side of the step contract strictly: it keeps each request's
tokens and block table only from what plans say, writes every computed token into a simulated
paged KV cache and, before sampling, reads the whole context back through the block table. What
a slot holds stands for real KV: the position and a digest of every token up to it, so a table
may share another request's block (a prefix-cache hit) only when the whole prefix agrees. A block
table that points at other KV, a wrong position or a wrong token fails loudly.
Its sampled token depends only on (request id, output index), like the real worker's seeded
draw, so recomputation after preemption must reproduce every output. With a `drafter` it
speculates as the real worker does (docs/design/speculation.md): the drafts join the step, their
KV is written (a wrong draft's KV is wrong: reading it later fails), a draft is accepted while it
equals the model's token for its index, and the rejected ones leave the history.
"""

from __future__ import annotations

import copy
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, TypeVar

import pytest

from services.scheduler import Scheduler, SchedulerConfig, StepRecord
from services.worker.held_batch import ExpandedStep, HeldBatch
from services.worker.plan_writer import PlanWriter
from shared.protocol.engine_channel import OutputBatch, RequestOutput, SubmitRequest
from shared.protocol.errors import ErrorCode
from shared.protocol.sampling import SamplingParams
from shared.protocol.worker_channel import DraftOutcome, StepPlan, StepResult


def token_for(rid: str, index: int, vocab_size: int) -> int:
    """The deterministic 'model': output token number `index` of request `rid`."""
    return zlib.crc32(f"{rid}:{index}".encode()) % vocab_size


@dataclass
class _Seq:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_cached: int = 0
    digests: list[int] = field(default_factory=list)  # [p]: digest of token_ids[: p + 1]

    def drop_last(self, num: int) -> None:
        """Rejected drafts leave the history and the computed count (their KV stays wrong)."""
        if num:
            del self.token_ids[-num:]
            del self.digests[len(self.token_ids) :]
            self.num_cached -= num

    def digest(self, pos: int) -> int:
        """What real KV at `pos` depends on: every token up to and including it."""
        d = self.digests
        while len(d) <= pos:
            d.append(hash((d[-1] if d else 0, self.token_ids[len(d)])))
        return d[pos]


# (rid, output index of the step's sample, draft limit) -> the drafts it proposes
Drafter = Callable[[str, int, int], list[int]]


def random_drafter(p_right: float, seed: int, vocab_size: int) -> Drafter:
    """Drafts of random length up to the limit, each the model's token for its index with
    probability `p_right` (else another one): random acceptance counts."""
    rng = random.Random(seed)

    def draft(rid: str, index: int, limit: int) -> list[int]:
        out = []
        for j in range(rng.randint(0, limit)):
            right = token_for(rid, index + j, vocab_size)
            out.append(right if rng.random() < p_right else (right + 1) % vocab_size)
        return out

    return draft


class CheckingWorker:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int = 1000,
        max_model_len: int = 1 << 20,
        drafter: Optional[Drafter] = None,
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv: list[Optional[tuple[int, int]]] = [None] * (num_blocks * block_size)
        self.seqs: dict[str, _Seq] = {}
        self.held = HeldBatch(num_blocks, block_size, max_model_len)
        self.steps: list[ExpandedStep] = []  # every plan, explicit (tests look at them)
        self._by_step: dict[int, ExpandedStep] = {}
        self.num_steps = 0
        self.drafter = drafter
        self.num_proposed = self.num_accepted = 0  # drafts, since start

    def _slot(self, seq: _Seq, pos: int) -> int:
        return seq.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply `plan` to the persistent batch (worker/held_batch.py checks it against what
        is held), write the KV of every computed token, check every context, sample."""
        step = self.held.apply(plan)
        if plan.prev_step_id is None:  # a reset: the worker's batch starts empty
            self.seqs.clear()
        self.steps.append(step)
        self._by_step[plan.step_id] = step
        self.num_steps += 1
        for held in step.released:
            assert held.rid in self.seqs, f"released {held.rid} that the worker does not hold"
            del self.seqs[held.rid]
        starts = {h.rid: st for h, st in zip(step.seqs, step.start_positions, strict=True)}
        for held in step.new_seqs:  # > 0 cached: a prefix-cache hit
            assert held.rid not in self.seqs, f"{held.rid} sent as new while the worker holds it"
            cached = starts.get(held.rid, held.num_computed)
            self.seqs[held.rid] = _Seq(
                list(held.token_ids), held.num_prompt_tokens, held.block_ids, cached
            )
        if step.draft_limits and self.drafter is not None:
            self._propose(step, step.draft_limits)
        for held, start, n in zip(step.seqs, step.start_positions, step.num_tokens, strict=True):
            seq = self.seqs[held.rid]  # every sequence writes its KV first, as per layer
            assert start == seq.num_cached, f"{held.rid}: start {start} != cached {seq.num_cached}"
            assert len(seq.block_ids) * self.block_size >= start + n, f"{held.rid}: table short"
            for pos in range(start, start + n):
                self.kv[self._slot(seq, pos)] = (pos, seq.digest(pos))
            seq.num_cached = start + n
        tokens: list[int] = []
        spec: tuple[list[int], ...] = ([], [], [], [])  # rows, proposed, accepted, token ids
        for b, (held, sample) in enumerate(zip(step.seqs, step.sample, strict=True)):
            seq = self.seqs[held.rid]  # attention, sampling
            self._check_context(held.rid, seq)
            if sample:
                assert seq.num_cached == len(seq.token_ids), f"{held.rid}: samples too early"
                drafts = (step.drafts or {}).get(b, [])
                index = len(seq.token_ids) - len(drafts) - seq.num_prompt_tokens
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == token_for(
                    held.rid, index + accepted, self.vocab_size
                ):
                    accepted += 1
                if drafts:
                    seq.drop_last(len(drafts) - accepted)
                    self.held.settle(step, b, accepted)
                    spec[0].append(len(tokens))
                    spec[1].append(len(drafts))
                    spec[2].append(accepted)
                    spec[3].extend(drafts[:accepted])
                    self.num_proposed += len(drafts)
                    self.num_accepted += accepted
                token = token_for(held.rid, index + accepted, self.vocab_size)
                seq.token_ids.append(token)
                tokens.append(token)
        self.held.record_samples(step.sampled(), tokens)
        # batch order: the scheduler maps by position
        outcome = DraftOutcome(*spec) if spec[0] else None
        return StepResult(plan.step_id, tokens, drafts=outcome)

    def _propose(self, step: ExpandedStep, limits: dict[int, int]) -> None:
        """Each drafting sequence's drafts join its history (the held batch's and ours)."""
        assert self.drafter is not None
        for b, limit in limits.items():
            held = step.seqs[b]
            index = len(held.token_ids) - held.num_prompt_tokens  # its sample's output index
            drafts = self.drafter(held.rid, index, limit)
            self.held.propose(step, b, drafts)
            self.seqs[held.rid].token_ids.extend(drafts)

    def peek(self, plan: StepPlan) -> ExpandedStep:
        """`plan` made explicit (what it runs), before or after `execute`; peeking first does
        not change what the worker holds."""
        step = self._by_step.get(plan.step_id)
        return step if step is not None else copy.deepcopy(self.held).apply(plan)

    def _check_context(self, rid: str, seq: _Seq) -> None:
        """Attention reads every cached position through the table: each must hold the KV of
        this request's own prefix (another request writing into our blocks, or a cache hit on a
        block of another prefix, shows up here)."""
        for pos in range(seq.num_cached):
            got = self.kv[self._slot(seq, pos)]
            assert got == (pos, seq.digest(pos)), f"{rid}@{pos}: KV holds {got}"


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


def submit(
    rid: str, prompt_len: int, max_tokens: int, priority: int = 0, **sampling_kw: Any
) -> SubmitRequest:
    """A greedy request with a prompt derived from its id."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling_kw)
    prompt = [(zlib.crc32(rid.encode()) + i) % 997 + 3 for i in range(prompt_len)]
    return SubmitRequest(rid, prompt, sampling, priority=priority)


@dataclass
class Run:
    """What a driven run produced: per rid its outputs, in order."""

    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    plans: list[ExpandedStep] = field(default_factory=list)  # each plan, as the worker saw it
    records: list[object] = field(default_factory=list)

    def add(self, outs: OutputBatch | list[RequestOutput]) -> None:
        if isinstance(outs, OutputBatch):
            outs = outs.as_outputs()
        for out in outs:
            self.outputs.setdefault(out.rid, []).append(out)

    def tokens(self, rid: str) -> list[int]:
        return [t for out in self.outputs[rid] for t in out.new_token_ids]

    def num_preemptions(self, rid: str) -> int:
        timings = self.final(rid).timings
        assert timings is not None, "a final output carries timings"
        return timings.num_preemptions

    def final(self, rid: str) -> RequestOutput:
        finals = [o for o in self.outputs[rid] if o.finish_reason is not None]
        assert len(finals) == 1, f"{rid} finished {len(finals)} times"
        assert self.outputs[rid][-1] is finals[0], f"{rid} has output after its final one"
        return finals[0]


class Arrival(Protocol):
    """A request of a random workload (each property test draws its own kind): it arrives
    before `step`'s schedule(), and is aborted at `abort_step`, before that step's schedule()
    or, with `abort_in_flight`, while that step's plan is at the worker."""

    @property
    def step(self) -> int: ...

    @property
    def abort_step(self) -> Optional[int]: ...

    @property
    def abort_in_flight(self) -> bool: ...

    def request(self, rid: str) -> SubmitRequest: ...


A = TypeVar("A", bound=Arrival)
REFUSALS = (ErrorCode.PROMPT_TOO_LONG, ErrorCode.OVERLOADED)  # what a random workload may meet


def arrive(
    sched: Scheduler, workload: list[A], step: int, in_flight: bool, run: Run
) -> dict[str, A]:
    """Called twice a step: before schedule() (`in_flight` False: arrivals, then aborts) and
    while the plan is at the worker (aborts only). Request i is "r{i}"; returns those admitted
    (a refusal must be one a random workload may meet)."""
    admitted = {}
    for i, a in enumerate(workload):
        rid = f"r{i}"
        if a.step == step and not in_flight:
            refused = sched.add_request(a.request(rid))
            if refused is None:
                admitted[rid] = a
            else:
                assert refused.code in REFUSALS, refused
        if a.abort_step == step and a.abort_in_flight == in_flight:
            out = sched.abort_request(rid)
            run.add([out] if out is not None else [])
    return admitted


def last_record(sched: Scheduler) -> StepRecord:
    """The step record of the last plan `schedule()` built (it is in flight)."""
    flight = sched.in_flight.newest()
    assert flight is not None, "no plan in flight"
    return flight.record


def check_composition(sched: Scheduler, plan: Optional[StepPlan]) -> None:
    """The plan just built has its step composition's shape (its step record says which of its
    requests computed prompt chunks and which decoded)."""
    if plan is None:
        return
    flight = sched.in_flight.newest()
    assert flight is not None and flight.step_id == plan.step_id
    is_prefill = flight.record.is_prefill
    composition = sched.config.step_composition
    if composition != "mixed":
        assert all(is_prefill) or not any(is_prefill), f"{composition}: a mixed forward"
    if composition == "decode-first":
        assert sum(is_prefill) <= sched.config.max_prefill_chunks


def drive(
    sched: Scheduler,
    worker: CheckingWorker,
    clock: FakeClock,
    max_steps: int = 10_000,
    step_time: float = 0.01,
    before_step: Optional[Callable[[int], None]] = None,
    run: Optional[Run] = None,
) -> Run:
    """Schedule -> worker -> update until nothing is left, checking invariants each step."""
    run = run if run is not None else Run()
    for i in range(max_steps):
        if before_step is not None:
            before_step(i)
        plan = sched.schedule()
        sched.check_invariants()
        if plan is None:
            if not sched.has_work():
                if before_step is None:
                    return run
                clock.advance(step_time)
                continue
            timeout = sched.next_timeout()
            assert timeout is not None, "work left, nothing scheduled and no timer: stuck"
            clock.advance(max(timeout, step_time))
            continue
        assert plan.num_scheduled_tokens <= sched.config.max_num_batched_tokens
        run.records.append(last_record(sched))
        clock.advance(step_time)
        result = worker.execute(plan)
        run.plans.append(worker.steps[-1])
        run.add(sched.update(result))
        sched.check_invariants()
    if sched.has_work():
        raise AssertionError(f"not done after {max_steps} steps")
    return run


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 256,
    eos: tuple[int, ...] = (),
    **config: Any,
) -> tuple[Scheduler, CheckingWorker, FakeClock]:
    """A scheduler (max_num_seqs 8 unless given) on a fake clock, and its checking worker."""
    config.setdefault("max_num_seqs", 8)
    clock = FakeClock()
    sched_config = SchedulerConfig(**config)
    sched = Scheduler(sched_config, num_blocks, block_size, max_model_len, list(eos), clock=clock)
    return sched, CheckingWorker(num_blocks, block_size, max_model_len=max_model_len), clock


# ---- tests of the checking worker itself: it must catch what it is there to catch ------------


def test_worker_detects_a_block_shared_by_two_requests() -> None:
    worker = CheckingWorker(num_blocks=2, block_size=4)
    sp = SamplingParams(temperature=0.0)
    writer = PlanWriter()
    new = [
        writer.new_sequence("a", [1, 2], 2, [0], sp),
        writer.new_sequence("b", [3, 4], 2, [0], sp),
    ]
    plan = writer.plan({"a": 2, "b": 2}, new)
    with pytest.raises(AssertionError, match="KV holds"):
        worker.execute(plan)


def test_worker_tokens_depend_only_on_rid_and_index() -> None:
    assert token_for("r1", 3, 1000) == token_for("r1", 3, 1000)
    assert len({token_for("r1", i, 1000) for i in range(50)}) > 10
