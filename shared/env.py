"""Every CONVEYOR_* environment variable, in one place.

Services read their flag defaults through these helpers, so a flag always beats the environment
and the environment beats the built-in default. Add new variables to `KNOWN` with a description.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from shared.console_format import LOG_FORMATS

PREFIX = "CONVEYOR_"

# name (without prefix) -> what it sets
KNOWN: dict[str, str] = {
    "CACHE_DIR": "where converted models are cached (default ~/.cache/conveyor)",
    "LOG_LEVEL": "log level of every service (default info)",
    "LOG_DIR": "also write logs/<service>.log there",
    "LOG_FORMAT": "stdout logs: console | json | auto (default: console on a terminal, else JSON)",
    "FRONTEND_ADDR": "client-facing address of the tokenizer service",
    "SCHEDULER_ADDR": "scheduler address the tokenizer services connect to",
    "SCHEDULER_ADDRS": "tokenizer: comma-separated scheduler addresses, one per engine (data "
    "parallelism); beats SCHEDULER_ADDR",
    "ROUTER_POLICY": "tokenizer: auto | round-robin | least-load | cache-aware (default auto)",
    "ROUTER_BALANCE_ABS": "tokenizer: cache-aware overload margin, requests (default 32)",
    "ROUTER_BALANCE_REL": "tokenizer: cache-aware overload factor (default 1.5)",
    "ENGINE": "scheduler/worker: the engine's name, added as `engine` to every log line "
    "(conveyor up sets it per engine)",
    "WORKER_ADDR": "scheduler <-> worker address",
    "MODEL": "model: 'smollm2' (default), a .gguf file or a Hugging Face folder",
    "HTTP_HOST": "address the HTTP gateway listens on (default 127.0.0.1)",
    "HTTP_PORT": "port the HTTP gateway listens on (default 8000)",
    "API_KEY": "when set, the HTTP gateway requires 'Authorization: Bearer <key>' on /v1/*",
    "SERVED_MODEL_NAME": "model name the HTTP gateway answers to (default: from MODEL)",
    "STATS_INTERVAL": "seconds between the HTTP gateway's engine stats polls (default 2)",
    "FRONTEND_ID": "tokenizer: this frontend's id, unique per engine (default random)",
    "HARD_CAP_BYTES": "tokenizer: zmq.MAXMSGSIZE; larger frames drop the peer",
    "SCHEDULER_TIMEOUT": "tokenizer: scheduler silence (s) before in-flight requests fail",
    "LOG_FILE": "a service's own log file (the launcher sets logs/<service>.log)",
    "NUM_WORKERS": "scheduler: worker ranks to wait for before admitting requests (default 1)",
    "MAX_FRAME_BYTES": "tokenizer: largest client frame before answering frame_too_large",
    "FRONTEND_TIMEOUT": "scheduler: seconds of frontend silence before its requests are aborted",
    "SUMMARY_INTERVAL": "scheduler: seconds between engine_summary log lines (default 5, 0 off)",
    "DRAIN_TIMEOUT": "SIGTERM grace period (s) for in-flight requests before stopping",
    "CURVE_KEYS": "tokenizer/gateway/up: folder of `conveyor keys generate` (CURVE on the client "
    "protocol)",
    "SERVER_KEY": "clients/gateway: the CURVE server public key file (DIR/server.key)",
    "CLIENT_KEY": "clients/gateway: the CURVE client key pair file (DIR/client.key_secret)",
    "RANK": "worker: this process's rank in its tensor-parallel group (0 samples and answers)",
    "WORLD_SIZE": "worker: ranks of its tensor-parallel group (default 1)",
    "DIST_INIT": "worker: tcp://HOST:PORT where the tensor-parallel ranks meet (rank 0 listens; "
    "not authenticated: loopback or a private network only)",
    "DIST_TIMEOUT": "worker: seconds (<= 30) for the rendezvous and each collective",
    "TENSOR_PARALLEL_SIZE": "up / simworker: worker ranks sharding the model (default 1)",
    "READY_FILE": "worker: a file created once the worker said ready (container healthcheck)",
    "HEAP_TRIM": "worker: give freed heap back to the OS when idle (default 1; 0 keeps glibc's "
    "caches, as bench/soak.py --compare-untrimmed does)",
    # Every SchedulerConfig / WorkerConfig field is also CONVEYOR_<FIELD> (shared/config_flags.py)
    "MAX_NUM_SEQS": "scheduler: requests running at once",
    "MAX_NUM_BATCHED_TOKENS": "scheduler: token budget of one step",
    "CHUNK_SIZE": "scheduler: prompt tokens of one request per step",
    "BATCH_SIZE": "scheduler: dynamic/static batch size",
    "POLICY": "scheduler: fcfs | priority | short-first",
    "BATCHING": "scheduler: continuous | dynamic | static",
    "ASYNC_SCHEDULING": "scheduler: overlap scheduling, plan N+1 sent while step N runs (default "
    "1; 0: one plan in flight)",
    "DTYPE": "worker: float32 | bfloat16 | ...",
    "AUTO_DTYPE": "worker: what --dtype auto becomes on CPU (float32 | bfloat16), instead of "
    "the GEMM probe's choice (tests pin it to run the suite as another CPU would)",
    "KV_CACHE_MEMORY": "worker: memory for the KV cache",
}


def env_str(name: str, default: Optional[str] = None) -> Optional[str]:
    """CONVEYOR_<name>, or `default` when unset or empty."""
    value = os.environ.get(PREFIX + name)
    return value if value else default


def env_int(name: str, default: Optional[int] = None) -> Optional[int]:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{PREFIX}{name}={raw!r} is not an integer") from None


def env_float(name: str, default: Optional[float] = None) -> Optional[float]:
    raw = env_str(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{PREFIX}{name}={raw!r} is not a number") from None


def env_bool(name: str, default: bool = False) -> bool:
    raw = env_str(name)
    if raw is None:
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{PREFIX}{name}={raw!r} is not a boolean")


def env_list(name: str) -> list[str]:
    """CONVEYOR_<name> as a comma-separated list (blanks dropped); [] when unset or empty."""
    raw = env_str(name) or ""
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_path(name: str) -> Optional[Path]:
    """CONVEYOR_<name> as a Path, or None when unset or empty."""
    raw = env_str(name)
    return Path(raw) if raw else None


def add_log_flags(parser: Any) -> None:
    """`--log-file`, `--log-level` and `--log-format` (CONVEYOR_LOG_FILE, CONVEYOR_LOG_LEVEL,
    CONVEYOR_LOG_FORMAT) on a parser or argument group; every service takes the same three."""
    parser.add_argument("--log-file", type=Path, default=env_path("LOG_FILE"))
    parser.add_argument("--log-level", default=env_str("LOG_LEVEL", "info"))
    add_log_format_flag(parser)


def add_drain_flag(parser: Any, default_s: float = 30.0) -> None:
    """`--drain-timeout` (CONVEYOR_DRAIN_TIMEOUT): the SIGTERM grace period, seconds, that the
    services which hold requests (scheduler, tokenizer) give in-flight requests."""
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=env_float("DRAIN_TIMEOUT", default_s),
        help="SIGTERM grace period for in-flight requests, seconds (CONVEYOR_DRAIN_TIMEOUT)",
    )


def add_log_format_flag(parser: Any) -> None:
    """`--log-format console|json|auto` (CONVEYOR_LOG_FORMAT, default auto): what stdout gets;
    log files are JSON whatever it says."""
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=env_str("LOG_FORMAT", "auto"),
        help="stdout logs: console lines, JSON lines, or auto (console on a terminal)",
    )
