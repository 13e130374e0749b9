"""ModelRunner: the worker's engine room, usable in-process (the process loop wraps it).

Start: resolve and (once) convert the model, load weights, size and allocate the KV pool.
Step: apply the plan to the persistent batch, build flat tensors, run one forward over the mixed
batch, sample at the rows that asked, return a StepResult.

Pipelined (`pipeline_steps`, pipeline.py): `launch` does a step up to sampling without waiting
for its tokens on the host, `finish` lands them and builds the StepResult; the worker loop
launches step N+1 between the two, its decodes reading step N's tokens on the device.

Tensor parallel (parallel.py): every rank runs every plan on its shard; rank 0 samples from the
gathered logits and broadcasts the tokens, so every rank records them. A failure once the
forward has started leaves the group out of step: it is fatal (FatalWorkerError), the process
exits and its supervisor restarts the whole group.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Optional

import structlog
import torch

from services.worker.config import (
    ParallelConfig,
    WorkerConfig,
    check_divides,
    pipelines_steps,
    resolve_dtype,
)
from services.worker.dtype_probe import resolve_auto_dtype
from services.worker.held_batch import ExpandedStep, HeldBatch, HeldSeq
from services.worker.input_batch import InputBatch
from services.worker.kv_cache import KVCache, num_blocks_for
from services.worker.loop import FatalWorkerError
from services.worker.model import LlamaModel
from services.worker.ops import TorchOps
from services.worker.ops_cpu import CpuOps, cache_base, try_load_cpu_ext
from services.worker.parallel import Group, agree_dtype, join_group
from services.worker.pipeline import (
    PENDING_TOKEN,
    DeviceClock,
    LaunchedStep,
    copy_to_host,
    device_rows,
    land,
)
from services.worker.sampler import SampleRow, is_plain_greedy, reads_history, sample
from services.worker.weights import ModelArgs, load_weights, model_args
from shared.model_files import eos_token_ids, model_name, prepare_model
from shared.protocol.worker_channel import StepPlan, StepResult, TokenLogprobs, WorkerReady

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_ops(config: WorkerConfig, args: ModelArgs, dtype: torch.dtype, log: Any) -> Any:
    """CpuOps (the C++ extension) on CPU, TritonOps on CUDA, or what `attention_backend`
    forces. On CPU, "auto" falls back to TorchOps (logged) when the extension cannot be built or
    does not cover the model; "cpu" forced makes that a ValueError. Triton is imported only when
    chosen, so the CPU path never needs it."""
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if config.device.startswith("cuda") else "cpu"
    if backend == "torch":
        return TorchOps()
    if backend == "cpu":
        return _cpu_ops(config, args, dtype, log)
    from services.worker.ops_triton import TritonOps

    return TritonOps()


def _cpu_ops(config: WorkerConfig, args: ModelArgs, dtype: torch.dtype, log: Any) -> Any:
    forced = config.attention_backend == "cpu"
    if config.device != "cpu" or not CpuOps.supports(args.head_dim, dtype):
        why = f"the C++ CPU kernels do not cover device={config.device} head_dim={args.head_dim} "
        why += f"dtype={dtype}"
        if forced:
            raise ValueError(why)
        log.warning("cpu_ext_not_used", reason=why, fallback="torch")
        return TorchOps()
    ext = try_load_cpu_ext(log)
    if ext is None:
        if forced:
            raise ValueError("attention_backend=cpu but the C++ CPU extension did not build")
        return TorchOps()
    return CpuOps(ext)


def worker_cores() -> int:
    """CPUs this process may run on (its affinity mask): torch's intra-op threads default."""
    return len(os.sched_getaffinity(0))


class ModelRunner:
    """Owns the model (its shard), the KV cache and per-request state of one worker rank."""

    def __init__(
        self,
        config: WorkerConfig,
        log: Optional[Any] = None,
        parallel: Optional[ParallelConfig] = None,
    ) -> None:
        """Load everything; ValueError with a clear message on a bad model, an unsupported
        architecture, a world size that does not divide the heads, or a KV budget too small for
        one max-length sequence. `parallel`: this rank's place in a tensor-parallel group (None:
        the only rank); joining blocks until every rank arrives (RuntimeError after the
        time-out). `log` (structlog) receives start-up facts; None uses structlog's default."""
        self.config = config
        self.log = log if log is not None else structlog.get_logger().bind(service="worker")
        self.parallel = parallel or ParallelConfig()
        self.folder: Path = prepare_model(config.model)
        self.args: ModelArgs = model_args(self.folder)
        a, world = self.args, self.parallel.world_size
        check_divides(world, a.num_heads, a.num_kv_heads, a.intermediate_size)
        self.max_model_len = self._max_model_len(config, self.args)
        self.pipelining = pipelines_steps(config, world)  # before joining: fail fast
        self.group: Group = join_group(self.parallel, config.device)
        # None: torch's default (which honours OMP_NUM_THREADS), capped at this rank's share
        # of the CPUs (ranks on one host split its cores)
        share = max(1, worker_cores() // self.group.num_local_ranks)
        threads = config.num_threads or min(torch.get_num_threads(), share)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self.dtype_name = agree_dtype(self.group, self._own_dtype(), tuple(TORCH_DTYPES))
        self.dtype = TORCH_DTYPES[self.dtype_name]
        # this rank's KV pool holds its share of the KV heads
        local = dataclasses.replace(a, num_heads=a.num_heads // world,
                                    num_kv_heads=a.num_kv_heads // world)  # fmt: skip
        num_blocks = num_blocks_for(local, config, self.dtype, self.max_model_len)
        weights = load_weights(self.folder, self.dtype, config.device)
        ops = make_ops(config, self.args, self.dtype, self.log)
        self.log.info("worker_ops", ops=ops.name, threads=torch.get_num_threads(),
                      rank=self.group.rank, world_size=world)  # fmt: skip
        self.model = LlamaModel(
            self.args, weights, ops, self.max_model_len, config.device, self.group
        )
        del weights
        self.kv_cache = KVCache(local, num_blocks, config.block_size, self.dtype, config.device)
        self.batch = InputBatch(config.block_size, num_blocks, self.max_model_len, config.device)
        self.last_tool_step: Optional[ExpandedStep] = None  # compute_logits' last plan
        # the last step launched (pipelined), while its tokens may still be only on the device
        self._last_launch: Optional[LaunchedStep] = None
        self.num_device_inputs = 0  # decode tokens taken from a previous step's device tensor
        self.clock = DeviceClock(config.device, self.log)
        self.model_name = model_name(self.folder)
        self.eos_token_ids = eos_token_ids(self.folder)

    def _own_dtype(self) -> Optional[str]:
        """The dtype this rank would pick; only rank 0's counts (agree_dtype), so only rank 0
        runs the `auto` probe."""
        if self.group.rank != 0:
            return None
        return resolve_dtype(self.config) or resolve_auto_dtype(
            self.args, cache_base() / "dtype", self.log
        )

    def close(self) -> None:
        """Leave the tensor-parallel group (called once at process exit)."""
        self.group.close()

    @staticmethod
    def _max_model_len(config: WorkerConfig, args: ModelArgs) -> int:
        limit = args.max_position_embeddings
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}: lower --max-model-len"
            )
        return config.max_model_len

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
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """One step: one forward over every scheduled token, then sampling. Raises ValueError
        on a plan that does not fit the worker's batch (the loop reports a WorkerFailure; every
        rank sees the same plan, so all refuse it alike), FatalWorkerError when a rank of a
        tensor-parallel group fails after the forward started. Any failure leaves the batch
        needing a reset plan."""
        start = time.perf_counter()
        self._land_launched()
        try:
            step = self.batch.apply_plan(plan)
            if not step.seqs:
                return StepResult(step_id=plan.step_id, token_ids=[])
            return self._run(step, start)
        except BaseException:
            self.batch.held.fail()
            raise

    def _run(self, step: ExpandedStep, start: float) -> StepResult:
        """Forward and sampling of an applied step; with several ranks any error is fatal."""
        try:
            tensors = self.batch.tensors(step)
            begin = self.clock.mark()
            logits = self.model.forward(tensors, self.kv_cache.layers)
            end = self.clock.mark()
            result = self._finish(step, logits, start)  # logits: [S, V] on rank 0, else None
            self.clock.on_step(begin, end)
            return result
        except FatalWorkerError:
            raise
        except Exception as exc:
            if self.group.world_size == 1:
                raise
            raise FatalWorkerError(f"rank {self.group.rank} failed mid-step: {exc!r}") from exc

    @torch.inference_mode()
    def compute_logits(self, plan: StepPlan) -> Optional[torch.Tensor]:
        """Like `execute` without sampling: the float32 logits [B, V] at the last computed
        position of every sequence that computes (sampling or not), in batch order (None on
        ranks other than 0). For tests and tools; the batch moves the same way (histories
        excepted: a decode of a sequence after it needs a token, so only chunks of known tokens
        may follow, unless `record_tokens` gives every rank the chosen tokens)."""
        self._land_launched()
        step = self.batch.apply_plan(plan)
        self.last_tool_step = step
        tensors = self.batch.tensors(step, every_row=True)
        logits = self.model.forward(tensors, self.kv_cache.layers)
        return None if logits is None else logits.float()

    def record_tokens(self, token_ids: list[int]) -> None:
        """After `compute_logits`: append the tokens a tool chose for that plan's sequences that
        reached the end of their histories (batch order), as `execute` appends its samples."""
        if self.last_tool_step is None:
            raise ValueError("record_tokens() without a compute_logits() before it")
        HeldBatch.record_samples(self.last_tool_step.sampled(), token_ids)

    def _sample_rows(self, sampled: list[HeldSeq]) -> list[SampleRow]:
        return [
            SampleRow(
                params=s.sampling,
                seed=self.batch.seed(s),
                output_index=s.num_output_tokens,
                token_ids=s.token_ids,
                num_prompt_tokens=s.num_prompt_tokens,
            )
            for s in sampled
        ]

    def _finish(
        self, step: ExpandedStep, logits: Optional[torch.Tensor], start: float
    ) -> StepResult:
        sampled = step.sampled()
        rows = self._sample_rows(sampled)
        token_ids: list[int] = []
        logprobs: list[Optional[TokenLogprobs]] = [None] * len(rows)
        if rows and logits is not None:  # rank 0 samples
            token_ids, logprobs = sample(logits, rows)
        # every rank holds the sampled tokens at the end of the step
        token_ids = self.group.broadcast_ints(token_ids, len(rows)) if rows else []
        HeldBatch.record_samples(sampled, token_ids)
        return _step_result(step.step_id, sampled, token_ids, logprobs, start)

    # --- pipelined steps (`pipeline_steps`; the loop in services/worker/loop.py) ----------------

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Apply the plan, build the inputs, queue the forward and the sampling; the tokens stay
        on the device (greedy rows) and are copied to the host without waiting. Called once
        per plan, in order; a step launched before may still be unfinished (its decodes read its
        tokens on the device). Raises like `execute` (the batch then needs a reset plan); the
        step launched before stays finishable."""
        if not self.pipelining:
            raise ValueError("launch() needs pipeline_steps on (this runner executes steps)")
        start = time.perf_counter()
        try:
            step = self.batch.apply_plan(plan)
            launched = self._launch(step, start)
        except BaseException:
            self.batch.held.fail()
            raise
        self._last_launch = launched
        return launched

    def _launch(self, step: ExpandedStep, start: float) -> LaunchedStep:
        sampled = step.sampled()
        rows = self._sample_rows(sampled)
        prev = self._last_launch
        on_device = all(is_plain_greedy(r.params) for r in rows)
        if prev is not None and any(reads_history(r.params) for r in rows):
            land(prev)  # penalties read the histories: step N's tokens must be in them
        if not step.seqs:
            empty = torch.empty(0, dtype=torch.int64)
            return LaunchedStep(step, [], [], start, None, empty, None, [], token_ids=[])
        tensors = self.batch.tensors(step)
        if prev is not None and prev.token_ids is None:
            where, src = device_rows(step, prev)
            if where and prev.device_tokens is not None:
                # the decodes of step N's samples: their tokens never left the device
                up = self.batch.upload
                from_prev = prev.device_tokens[up(torch.tensor(src))]
                tensors.input_ids[up(torch.tensor(where))] = from_prev
                self.num_device_inputs += len(where)
        marks = (self.clock.mark(), None)
        logits = self.model.forward(tensors, self.kv_cache.layers)  # [S, V]
        marks = (marks[0], self.clock.mark())
        if not rows:
            empty = torch.empty(0, dtype=torch.int64)
            return LaunchedStep(step, [], [], start, None, empty, None, [], token_ids=[],
                                marks=marks)  # fmt: skip
        if logits is None:
            raise FatalWorkerError("pipelined step without logits (several ranks)")
        if on_device:
            tokens = logits.argmax(dim=1)  # [S] int64, on the device
            host, ready = copy_to_host(tokens)
            for seq in sampled:
                seq.token_ids.append(PENDING_TOKEN)  # written by land()
            positions = [len(seq.token_ids) - 1 for seq in sampled]
            return LaunchedStep(step, sampled, positions, start, tokens, host, ready,
                                [None] * len(rows), marks=marks)  # fmt: skip
        # the host path (seeded draws, logprobs, penalties): it waits for this step's logits,
        # so the next step is not built while this one runs; its tokens land at once
        token_ids, logprobs = sample(logits, rows)
        HeldBatch.record_samples(sampled, token_ids)
        positions = [len(seq.token_ids) - 1 for seq in sampled]
        host = torch.tensor(token_ids, dtype=torch.int64)
        return LaunchedStep(step, sampled, positions, start, None, host, None, logprobs,
                            token_ids=token_ids, marks=marks)  # fmt: skip

    def finish(self, launched: LaunchedStep) -> StepResult:
        """Land a launched step's tokens (waits for the device) and build its StepResult.
        Called once per launched step, in launch order (step N after step N+1's launch, or at
        once). Raises when its tokens cannot be brought back: the batch then needs a reset
        plan, and a step launched after it must be `discard`ed."""
        try:
            token_ids = land(launched)
        except BaseException:
            self.batch.held.fail()
            raise
        if self._last_launch is launched:
            self._last_launch = None  # its tokens are in the histories: the next step reads them
        self.clock.on_step(*launched.marks)
        return _step_result(
            launched.step_id, launched.sampled, token_ids, launched.logprobs, launched.start
        )

    def discard(self, launched: LaunchedStep) -> None:
        """Drop a launched step that read a failed step's tokens: nothing of it is reported,
        and the batch needs a reset plan (which drops the histories it extended)."""
        self.batch.held.fail()
        if self._last_launch is launched:
            self._last_launch = None

    def _land_launched(self) -> None:
        """Before a synchronous step or tool call: land a launched step still in flight."""
        if self._last_launch is not None:
            land(self._last_launch)
            self._last_launch = None


def _step_result(
    step_id: int,
    sampled: list[HeldSeq],
    token_ids: list[int],
    logprobs: list[Optional[TokenLogprobs]],
    start: float,
) -> StepResult:
    """A step's result: tokens in batch order (the scheduler maps them by position), logprobs
    by rid for the rows that asked, and the worker's time since the step began."""
    lp = {s.rid: entry for s, entry in zip(sampled, logprobs, strict=True) if entry is not None}
    return StepResult(
        step_id=step_id,
        token_ids=token_ids,
        logprobs=lp,
        forward_s=time.perf_counter() - start,
    )
