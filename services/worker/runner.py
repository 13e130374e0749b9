"""ModelRunner: one worker rank's step, usable in-process (the process loop wraps it).

Start: resolve and (once) convert the model, load weights, size and allocate the KV pool.
Step: the runner owns it and walks it one way, each piece of state with one owner:

    plan -> HeldBatch.apply (the sequences: histories, block tables, computed counts)
         -> InputBatch.tensors (the step's flat tensors on the device)
         -> LlamaModel.forward (writes K/V into the KVCache, returns logits), while the
            grammar masks of constrained sequences are computed beside it (constraints.py)
         -> sample -> HeldBatch.record_samples -> StepResult

A failed step tells the held batch (`fail`: only a reset plan is accepted next). Pipelined
(pipeline.py): `launch` does a step up to sampling without waiting for its tokens on the host,
`finish` lands them (HeldBatch.land_samples) and builds the StepResult; the worker loop
(services/worker/steps.py) launches step N+1 between the two, reading N's tokens on the device.

Tensor parallel (parallel.py): every rank runs every plan on its shard; rank 0 samples from the
gathered logits and broadcasts the tokens, so every rank records them; with speculation rank 0
proposes and verifies, and broadcasts its drafts and accepted counts (spec_ranks.py). A failure
once the forward has started is fatal (FatalWorkerError): the group restarts whole.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Optional

import structlog
import torch

from services.worker.backend import set_threads
from services.worker.config import (
    ParallelConfig,
    WorkerConfig,
    check_divides,
    pipelines_steps,
    resolve_kv_cache_dtype,
    resolve_quantization,
)
from services.worker.constraints import ConstraintMasks, PendingMasks, RowMasks
from services.worker.draft_model import load_draft
from services.worker.held_batch import ExpandedStep, HeldBatch, HeldSeq
from services.worker.input_batch import InputBatch
from services.worker.kv_cache import KVCache, num_blocks_for
from services.worker.kv_sizing import kv_budget_bytes
from services.worker.loading import load_model, max_model_len, own_dtype
from services.worker.model import LlamaModel, StepTensors
from services.worker.parallel import Group, agree_dtype, join_group
from services.worker.pipeline import (
    DeviceClock,
    LaunchedStep,
    OverlapRule,
    check_pending,
    copy_to_host,
    device_rows,
    known_step,
    wait_for_tokens,
)
from services.worker.pooling import Pooler
from services.worker.sampler import (
    SampleRow,
    apply_token_masks,
    is_plain_greedy,
    reads_history,
    sample,
)
from services.worker.spec_ranks import share_drafts, share_samples
from services.worker.speculate import make_speculator, sample_rows, sample_step, sampler_drafts
from services.worker.steps import FatalWorkerError
from services.worker.warmup import CompileWatch, compile_kernels
from services.worker.weights import ModelArgs, model_args
from shared.model_files import eos_token_ids, model_name, prepare_model, source_gguf
from shared.protocol.worker_channel import StepPlan, StepResult, TokenLogprobs, WorkerReady

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Owns one worker rank's step, and the model (its shard), KV cache, held batch and input
    builder it runs it with."""

    def __init__(
        self,
        config: WorkerConfig,
        log: Optional[Any] = None,
        parallel: Optional[ParallelConfig] = None,
        overlap: Optional[OverlapRule] = None,
    ) -> None:
        """Load everything; ValueError with a clear message on a bad model, an unsupported
        architecture, a world size that does not divide the heads, or a KV budget too small for
        one max-length sequence. `parallel`: this rank's place in a tensor-parallel group (None:
        the only rank); joining blocks until every rank arrives (RuntimeError after the
        time-out). `log` (structlog) receives start-up facts; None uses structlog's default.
        `overlap`: when pipelined steps launch ahead (None: pipeline.py's rule, forced on by
        pipeline_steps "on")."""
        self.config = config
        self.log = log if log is not None else structlog.get_logger().bind(service="worker")
        self.parallel = parallel or ParallelConfig()
        self.folder: Path = prepare_model(config.model)
        self.args: ModelArgs = model_args(self.folder)
        self.gguf = source_gguf(self.folder)
        self.quantization = resolve_quantization(config, self.gguf is not None)
        a, world = self.args, self.parallel.world_size
        check_divides(world, a.num_heads, a.num_kv_heads, a.intermediate_size)
        self.max_model_len = max_model_len(config, self.args)
        self.pipelining = pipelines_steps(config, world)  # before joining: fail fast
        self.overlap = overlap or OverlapRule(forced=config.pipeline_steps == "on")
        self.group: Group = join_group(self.parallel, config.device)
        set_threads(config, self.group.num_local_ranks)
        rank_dtype = own_dtype(config, a, self.quantization, self.group.rank, self.log)
        self.dtype_name = agree_dtype(self.group, rank_dtype, tuple(TORCH_DTYPES))
        self.dtype = TORCH_DTYPES[self.dtype_name]
        # this rank's KV pool holds its share of the KV heads
        local = dataclasses.replace(a, num_heads=a.num_heads // world,
                                    num_kv_heads=a.num_kv_heads // world)  # fmt: skip
        kv_dtype = resolve_kv_cache_dtype(config, self.dtype_name)
        self.model: LlamaModel = load_model(
            config, a, self.folder, self.gguf, self.quantization, self.dtype, self.group,
            self.max_model_len, self.log,
        )  # fmt: skip
        # sized once the weights are in memory (and, on CUDA, after a profiling forward)
        budget = kv_budget_bytes(config, self.model, local, kv_dtype, self.max_model_len, self.log)
        num_blocks = num_blocks_for(local, config, kv_dtype, self.max_model_len, budget)
        self.kv_cache = KVCache(local, num_blocks, config.block_size, kv_dtype, config.device)
        self.compiles: Optional[CompileWatch] = compile_kernels(
            config, self.model, self.kv_cache, self.dtype, self.max_model_len, self.log
        )
        self.held = HeldBatch(num_blocks, config.block_size, self.max_model_len)
        self.inputs = InputBatch(config.block_size, config.device)
        self.clock = DeviceClock(config.device, self.log)
        self.pooler = Pooler()  # embedding requests' pooled hidden states
        self.last_tool_step: Optional[ExpandedStep] = None  # compute_logits' last plan
        self.num_device_inputs = 0  # decode tokens taken from a previous step's device tensor
        self.model_name = model_name(self.folder)
        self.eos_token_ids = eos_token_ids(self.folder)
        self.constraints: Optional[ConstraintMasks] = None  # grammar masks: rank 0's alone
        if self.group.rank == 0:  # it samples
            self.constraints = ConstraintMasks(self.folder, a.vocab_size, self.eos_token_ids)
        draft = partial(load_draft, config, a, self.kv_cache, self.dtype, self.max_model_len,
                        self.log)  # fmt: skip
        self.speculator = make_speculator(config, self.group.rank, self.pipelining, draft)

    def close(self) -> None:
        """Leave the tensor-parallel group (called once at process exit)."""
        self.group.close()

    def ready_message(self, rank: int = 0) -> WorkerReady:
        """The handshake the scheduler sizes its block pool from; sent once after start."""
        return WorkerReady(
            rank=rank,
            num_blocks=self.kv_cache.num_blocks,
            block_size=self.kv_cache.block_size,
            max_model_len=self.max_model_len,
            model_name=self.model_name,
            vocab_size=self.args.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            dtype=self.dtype_name,
            device=self.config.device,
            world_size=self.group.world_size,
            weight_bytes=self.model.weight_bytes(),
            kv_cache_bytes=self.kv_cache.num_bytes,
            proposer=None if self.config.speculative == "off" else self.config.speculative,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache.dtype_name,
        )

    def check_invariants(self, in_flight: Sequence[LaunchedStep] = ()) -> None:
        """Raise AssertionError when the worker's state is inconsistent; reads only (tests call
        it between steps). Each owner checks its own: the held batch its sequences, the KV
        cache the block use the held tables make of it, the pipeline the placeholders of the
        launched steps `in_flight` (what the loop holds, services/worker/steps.py)."""
        self.held.check_invariants()
        tables = [(s.block_ids, s.num_computed) for s in self.held.seqs.values()]
        self.kv_cache.check_invariants(tables)
        check_pending(self.held, in_flight)
        self.pooler.check_invariants()

    # --- one step at a time (the loop's `Steps`, tools) ------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """One step: one forward over every scheduled token, then sampling. Raises ValueError
        on a plan that does not fit the worker's batch (the loop reports a WorkerFailure; every
        rank sees the same plan, so all refuse it alike), FatalWorkerError when a rank of a
        tensor-parallel group fails after the forward started. Any failure leaves the batch
        needing a reset plan."""
        start = time.perf_counter()
        try:
            step = self.held.apply(plan)
            if not step.seqs:
                return StepResult(step_id=plan.step_id, token_ids=[])
            return self._run(step, start)
        except BaseException:
            self.held.fail()
            raise

    def _run(self, step: ExpandedStep, start: float) -> StepResult:
        """Forward and sampling of an applied step; with several ranks any error is fatal."""
        try:
            if self.speculator is not None:
                self.speculator.propose(self.held, step)
            share_drafts(self.group, self.held, step)  # tensor parallel: the same query tokens
            tensors = self.inputs.tensors(step)
            sampled = step.sampled()  # once: the masks and the sampling both read it
            masks = self.constraints and self.constraints.start(
                sampled, self.held.seqs.values(), sampler_drafts(step)
            )
            begin = self.clock.mark()
            logits = self._forward(step, tensors)  # [S, V] on rank 0
            end = self.clock.mark()
            result = self._sample_and_record(step, sampled, logits, start, masks)
            self.clock.on_step(begin, end)
            return result
        except FatalWorkerError:
            raise
        except Exception as exc:
            if self.group.world_size == 1:
                raise
            raise FatalWorkerError(f"rank {self.group.rank} failed mid-step: {exc!r}") from exc

    def _sample_and_record(
        self,
        step: ExpandedStep,
        sampled: list[HeldSeq],
        logits: Optional[torch.Tensor],
        start: float,
        pending: Optional[PendingMasks] = None,
    ) -> StepResult:
        rows = sample_rows(sampled)
        token_ids: list[int] = []
        logprobs: list[Optional[TokenLogprobs]] = [None] * len(rows)
        outcome = None  # speculation: what was accepted (speculate.py)
        masks = self.constraints.wait(pending) if self.constraints and pending else None
        if rows and logits is not None:  # rank 0 samples
            token_ids, logprobs, outcome = sample_step(self.speculator, self.held, step, logits,
                                                       rows, masks)  # fmt: skip
        if rows:  # every rank holds the step's tokens, less the drafts rank 0 rejected
            token_ids = share_samples(self.group, self.held, step, token_ids, outcome, len(rows))
        self.held.record_samples(sampled, token_ids)
        embeddings = self.pooler.take(step.step_id)
        result = _step_result(step.step_id, sampled, token_ids, logprobs, start, embeddings)
        return result if outcome is None else dataclasses.replace(result, drafts=outcome)

    def _forward(self, step: ExpandedStep, tensors: StepTensors) -> Optional[torch.Tensor]:
        """The model's forward; a step that computes embedding requests pools their hidden
        states on the way (Pooler: taken when the step's result is built)."""
        if not self.pooler.begin(step, self.held.seqs.values()):
            return self.model.forward(tensors, self.kv_cache.layers)
        x, residual = self.model.hidden_states(tensors, self.kv_cache.layers)
        self.pooler.pool(step, x, residual, self.model.final_norm)
        return self.model.logits(x, residual, tensors.logits_indices)

    @torch.inference_mode()
    def compute_logits(self, plan: StepPlan) -> Optional[torch.Tensor]:
        """Like `execute` without sampling: the float32 logits [B, V] at the last computed
        position of every sequence that computes (sampling or not), in batch order (None on
        ranks other than 0). For tools (bench/, tests); the batch moves the same way (histories
        excepted: a decode of a sequence after it needs a token, so only chunks of known tokens
        may follow, unless `record_tokens` gives every rank the chosen tokens)."""
        step = self.held.apply(plan)
        self.last_tool_step = step
        tensors = self.inputs.tensors(step, every_row=True)
        logits = self.model.forward(tensors, self.kv_cache.layers)
        return None if logits is None else logits.float()

    def record_tokens(self, token_ids: list[int]) -> None:
        """After `compute_logits`: append the tokens a tool chose for that plan's sequences that
        reached the end of their histories (batch order), as `execute` appends its samples."""
        if self.last_tool_step is None:
            raise ValueError("record_tokens() without a compute_logits() before it")
        self.held.record_samples(self.last_tool_step.sampled(), token_ids)

    # --- pipelined steps (the loop's `PipelinedSteps`, services/worker/steps.py) -----------------

    def overlaps(self) -> bool:
        """Whether the loop should keep this step in flight behind the next (OverlapRule)."""
        return self.overlap.overlaps()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: Optional[LaunchedStep]) -> LaunchedStep:
        """Apply the plan, build the inputs, queue the forward and the sampling; the tokens stay
        on the device (greedy rows) and are copied to the host without waiting. Called once
        per plan, in order; `prev`: the step launched before, if not finished yet (its decodes'
        tokens are read on the device). Raises like `execute` (the batch then needs a reset
        plan); `prev` stays finishable."""
        if not self.pipelining:
            raise ValueError("launch() needs pipeline_steps on (this runner executes steps)")
        start = time.perf_counter()
        try:
            step = self.held.apply(plan)
            rows = sample_rows(step.sampled())
            if prev is not None and any(reads_history(r.params) for r in rows):
                self._land(prev)  # penalties read the histories: step N's tokens must be in them
            if not step.seqs:
                return known_step(step, [], [], [], start, (None, None), 0.0)
            return self._launch(step, rows, self._step_inputs(step, prev), start, prev)
        except BaseException:
            self.held.fail()
            raise

    def _step_inputs(self, step: ExpandedStep, prev: Optional[LaunchedStep]) -> StepTensors:
        """The step's tensors; decodes of `prev`'s samples not landed take them on the device."""
        tensors = self.inputs.tensors(step)
        if prev is not None and not prev.landed and prev.device_tokens is not None:
            where, src = device_rows(step, prev)
            if where:
                self.inputs.take_device_tokens(tensors, where, prev.device_tokens, src)
                self.num_device_inputs += len(where)
        return tensors

    def _launch(
        self,
        step: ExpandedStep,
        rows: list[SampleRow],
        tensors: StepTensors,
        start: float,
        prev: Optional[LaunchedStep],
    ) -> LaunchedStep:
        begin = self.clock.mark()
        logits = self._forward(step, tensors)  # [S, V]
        marks = (begin, self.clock.mark())
        queued_s = time.perf_counter() - start
        sampled = step.sampled()
        if not rows:
            return known_step(step, [], [], [], start, marks, queued_s)
        if logits is None:
            raise FatalWorkerError("pipelined step without logits (several ranks)")
        masks: Optional[RowMasks] = None  # computed while the device runs the forward
        if self.constraints is not None and any(s.sampling.constraint for s in sampled):
            if prev is not None and not prev.landed:
                self._land(prev)  # a mask needs the last token on the host (prev ran first)
            masks = self.constraints.masks_now(sampled, list(self.held.seqs.values()))
        if all(is_plain_greedy(r.params) for r in rows):
            if masks is not None:
                apply_token_masks(logits, masks)
            tokens = logits.argmax(dim=1)  # [S] int64, on the device
            host, ready = copy_to_host(tokens)
            positions = self.held.reserve_samples(sampled)  # written by finish()
            return LaunchedStep(step, sampled, positions, start, tokens, host, ready,
                                [None] * len(rows), marks=marks, queued_s=queued_s)  # fmt: skip
        # the host path (seeded draws, logprobs, penalties): it waits for this step's logits,
        # so the next step is not built while this one runs; its tokens land at once
        token_ids, logprobs = sample(logits, rows, masks)
        self.held.record_samples(sampled, token_ids)
        return known_step(step, sampled, token_ids, logprobs, start, marks, queued_s)

    def finish(self, launched: LaunchedStep) -> StepResult:
        """Land a launched step's tokens (waits for the device) and build its StepResult.
        Called once per launched step, in launch order (step N after step N+1's launch, or at
        once). Raises when its tokens cannot be brought back: the batch then needs a reset
        plan, and a step launched after it must be `discard`ed."""
        try:
            token_ids = self._land(launched)
        except BaseException:
            self.held.fail()
            raise
        self.overlap.on_step(launched.queued_s, self.clock.on_step(*launched.marks))
        embeddings = self.pooler.take(launched.step_id)
        return _step_result(launched.step_id, launched.sampled, token_ids, launched.logprobs,
                            launched.start, embeddings)  # fmt: skip

    def discard(self, launched: LaunchedStep) -> None:
        """Drop a launched step that read a failed step's tokens: nothing of it is reported,
        and the batch needs a reset plan (which drops the histories it extended)."""
        self.held.fail()

    def _land(self, launched: LaunchedStep) -> list[int]:
        """A launched step's tokens, written into the histories the first time (idempotent)."""
        if launched.token_ids is None:
            tokens = wait_for_tokens(launched)
            self.held.land_samples(launched.sampled, launched.positions, tokens)
            launched.token_ids = tokens
        return launched.token_ids


def _step_result(
    step_id: int,
    sampled: list[HeldSeq],
    token_ids: list[int],
    logprobs: list[Optional[TokenLogprobs]],
    start: float,
    embeddings: dict[str, list[float]],
) -> StepResult:
    """A step's result: tokens in batch order (the scheduler maps them by position), logprobs
    and embeddings by rid for the rows that have them, the worker's time since the step
    began."""
    lp = {s.rid: entry for s, entry in zip(sampled, logprobs, strict=True) if entry is not None}
    return StepResult(
        step_id=step_id,
        token_ids=token_ids,
        logprobs=lp,
        forward_s=time.perf_counter() - start,
        embeddings=embeddings,
    )
