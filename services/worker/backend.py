"""Which kernels run the model (the ops object) and how many CPU threads the worker uses.

CpuOps (the C++ extension) on CPU, TritonOps on CUDA, TorchOps where neither applies or
`attention_backend` asks for it. Chosen once per process, at start.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from services.worker.config import WorkerConfig
from services.worker.ops import TorchOps
from services.worker.ops_cpu import CpuOps, try_load_cpu_ext
from services.worker.weights import ModelArgs


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


def set_threads(config: WorkerConfig, num_local_ranks: int) -> None:
    """torch's intra-op threads: `num_threads`, else torch's default (which honours
    OMP_NUM_THREADS) capped at this rank's share of the CPUs (ranks on one host split them)."""
    share = max(1, worker_cores() // num_local_ranks)
    threads = config.num_threads or min(torch.get_num_threads(), share)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
