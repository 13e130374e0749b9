"""ModelRunner: the worker's engine room, usable in-process (the process loop wraps it).

Start: resolve and (once) convert the model, load weights, size and allocate the KV pool.
Step: apply the plan to per-request state, build flat tensors, run one forward over the mixed
batch, sample at the rows that asked, return a StepResult.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from services.worker.config import WorkerConfig, resolve_dtype
from services.worker.input_batch import InputBatch, RequestState
from services.worker.kv_cache import KVCache, num_blocks_for
from services.worker.model import LlamaModel
from services.worker.ops import TorchOps
from services.worker.sampler import SampleRow, sample
from services.worker.weights import ModelArgs, load_weights, model_args
from shared.model_files import eos_token_ids, model_name, prepare_model
from shared.protocol.worker_channel import StepPlan, StepResult, TokenLogprobs, WorkerReady

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_ops(config: WorkerConfig) -> Any:
    """TorchOps on CPU, TritonOps on CUDA, or what `attention_backend` forces. Triton is
    imported only when chosen, so the CPU path never needs it."""
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if config.device.startswith("cuda") else "torch"
    if backend == "torch":
        return TorchOps()
    from services.worker.ops_triton import TritonOps

    return TritonOps()


class ModelRunner:
    """Owns the model, the KV cache and per-request state of one worker rank."""

    def __init__(self, config: WorkerConfig) -> None:
        """Load everything; ValueError with a clear message on a bad model, an unsupported
        architecture or a KV budget too small for one max-length sequence."""
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.folder: Path = prepare_model(config.model)
        self.args: ModelArgs = model_args(self.folder)
        self.max_model_len = self._max_model_len(config, self.args)
        self.dtype_name = resolve_dtype(config)
        self.dtype = TORCH_DTYPES[self.dtype_name]
        num_blocks = num_blocks_for(self.args, config, self.dtype, self.max_model_len)
        weights = load_weights(self.folder, self.dtype, config.device)
        self.model = LlamaModel(
            self.args, weights, make_ops(config), self.max_model_len, config.device
        )
        self.kv_cache = KVCache(self.args, num_blocks, config.block_size, self.dtype, config.device)
        self.batch = InputBatch(config.block_size, num_blocks, self.max_model_len, config.device)
        self.model_name = model_name(self.folder)
        self.eos_token_ids = eos_token_ids(self.folder)

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
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """One step: one forward over every scheduled token, then sampling. Raises ValueError
        on a plan inconsistent with the worker's state (the loop reports a WorkerFailure)."""
        start = time.perf_counter()
        states = self.batch.apply_plan(plan)
        sampled = [s for s, flag in zip(states, plan.sample, strict=True) if flag]
        if not states:
            return StepResult(step_id=plan.step_id, rids=[], token_ids=[])
        step = self.batch.tensors(plan, states)
        logits = self.model.forward(step, self.kv_cache.layers)  # [S, V] float32
        return self._finish(plan, sampled, logits, start)

    @torch.inference_mode()
    def compute_logits(self, plan: StepPlan) -> torch.Tensor:
        """Like `execute` without sampling: the float32 logits [S, V] of the sampling rows.
        For tests and tools; it updates request state the same way (histories excepted)."""
        states = self.batch.apply_plan(plan)
        return self.model.forward(self.batch.tensors(plan, states), self.kv_cache.layers)

    def _finish(
        self, plan: StepPlan, sampled: list[RequestState], logits: torch.Tensor, start: float
    ) -> StepResult:
        rows = [
            SampleRow(
                params=s.sampling,
                seed=s.seed,
                output_index=s.num_output_tokens,
                token_ids=s.token_ids,
                num_prompt_tokens=s.num_prompt_tokens,
            )
            for s in sampled
        ]
        token_ids, logprobs = sample(logits, rows) if rows else ([], [])
        self.batch.record_samples(sampled, token_ids)
        lp: dict[str, TokenLogprobs] = {
            s.rid: entry for s, entry in zip(sampled, logprobs, strict=True) if entry is not None
        }
        return StepResult(
            step_id=plan.step_id,
            rids=[s.rid for s in sampled],
            token_ids=token_ids,
            logprobs=lp,
            forward_s=time.perf_counter() - start,
        )
