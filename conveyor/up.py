"""`conveyor up` and `conveyor demo`: a LocalStack in the foreground.

Exit codes: 0 after Ctrl-C/SIGTERM (every service stopped), 1 when a service died (the worker,
typically: in-flight requests already got an error; restarting is not done here), 2 when the
stack did not become ready, or was refused before any start: a bad setting, or an exposure
without authentication (`exposure_refusal`).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Optional

from conveyor.console import ConsoleEcho
from conveyor.launcher import WORKER_KINDS, LocalStack, StackError, StackSettings, is_worker_rank
from services.scheduler.config import SchedulerConfig
from services.tokenizer.router import POLICIES as ROUTER_POLICIES
from services.worker.config import WorkerConfig
from shared.addresses import (
    DEFAULT_HTTP_HOST,
    DEFAULT_HTTP_PORT,
    default_frontend_address,
    is_local_address,
    is_loopback_host,
)
from shared.config_flags import add_config_flags
from shared.env import add_log_format_flag, env_int, env_path, env_str
from shared.logging import resolve_log_format

# Engine flags of `up`: every field of the services' config dataclasses, generated (the
# services take the same flags, so each is passed on as given). `model` is up's own --model.
WORKER_SKIP = ("model",)
SAMPLE_PROMPT = "What is continuous batching in LLM serving? Answer in two sentences."
DEATH_GRACE_S = 3.0  # a dead service, not restarted: let the others fail requests first
# what `--restart on-failure` brings back: the scheduler, and the worker ranks (always as a
# whole group: see LocalStack.restart_workers)
RESTARTABLE = ("scheduler", "worker")
# Back-off between restarts of one service: 0.5 s, doubling up to 10 s; a service that stayed up
# for STABLE_S starts again from the shortest delay.
FIRST_DELAY_S, MAX_DELAY_S, STABLE_S = 0.5, 10.0, 30.0


def add_up_commands(sub: Any) -> None:
    up = sub.add_parser("up", help="start tokenizer, scheduler, worker (and gateway)")
    _add_stack_flags(up)
    up.set_defaults(func=cmd_up)
    demo = sub.add_parser("demo", help="up + answer a sample prompt, keep serving until Ctrl-C")
    _add_stack_flags(demo)
    demo.add_argument("--prompt", default=SAMPLE_PROMPT)
    demo.set_defaults(func=cmd_demo)


def _add_stack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=env_str("MODEL"),
                   help="'smollm2' (default), a .gguf file or an HF folder")  # fmt: skip
    add_config_flags(p, SchedulerConfig)
    add_config_flags(p, WorkerConfig, skip=WORKER_SKIP)
    g = p.add_argument_group("engine summary")
    g.add_argument("--summary-interval", type=float,
                   help="seconds between engine_summary lines (default 5, 0: off)")  # fmt: skip
    d = p.add_argument_group("data parallelism")
    d.add_argument("--data-parallel-size", type=int, default=1,
                   help="engines (scheduler + worker each, own KV pool; on CUDA the i-th "
                   "visible GPU each) behind the one frontend")  # fmt: skip
    d.add_argument("--router-policy", choices=("auto", *ROUTER_POLICIES),
                   help="which engine gets a request (frontend default: auto)")  # fmt: skip
    w = p.add_argument_group("worker kind")
    w.add_argument("--worker", choices=WORKER_KINDS, default="model",
                   help="model: the real worker; sim: SIMULATED (services.worker.sim)")  # fmt: skip
    w.add_argument("--sim-device", help="simulated device profile (with --worker sim)")
    w.add_argument("--sim-model", help="simulated model shape (with --worker sim)")
    w.add_argument("--tensor-parallel-size", type=int,
                   default=env_int("TENSOR_PARALLEL_SIZE", 1),
                   help="worker ranks sharding the model over torch.distributed (gloo on CPU, "
                   "nccl on CUDA); it must divide the model's head counts. With --worker sim: "
                   "one process that models N ranks (CONVEYOR_TENSOR_PARALLEL_SIZE)")  # fmt: skip
    a = p.add_argument_group("addresses, HTTP gateway and logs")
    a.add_argument("--frontend-addr", default=default_frontend_address())
    a.add_argument("--no-gateway", action="store_true", help="do not start the HTTP gateway")
    a.add_argument("--http-host", default=DEFAULT_HTTP_HOST)
    a.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT)
    a.add_argument("--api-key", default=env_str("API_KEY"))
    a.add_argument("--curve-keys", type=Path, default=env_path("CURVE_KEYS"),
                   help="CURVE on the frontend: the folder of `conveyor keys generate` "
                   "(CONVEYOR_CURVE_KEYS)")  # fmt: skip
    a.add_argument("--served-model-name")
    a.add_argument("--log-dir", type=Path, default=Path(env_str("LOG_DIR", "logs") or "logs"))
    a.add_argument("--drain-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on Ctrl-C/SIGTERM")  # fmt: skip
    a.add_argument("--ready-timeout", type=float, default=600.0)
    f = p.add_argument_group("faults")
    f.add_argument("--restart", choices=("on-failure", "no"), default="on-failure",
                   help="restart a worker or scheduler that exits with an error, with back-off "
                   "(no: its death stops the engine)")  # fmt: skip
    f.add_argument("--max-retries", type=int,
                   help="restarts by recompute per request when the worker is lost, then "
                   "worker_failed (scheduler default 3)")  # fmt: skip
    a.add_argument("--quiet", action="store_true", help="logs to files only, not to stdout")
    add_log_format_flag(a)
    a.add_argument("--show-steps", action="store_true",
                   help="also print the scheduler's step lines (always in its log)")  # fmt: skip


def engine_flags(args: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """The fields of config `cls` given on our command line (or by CONVEYOR_<FIELD>), as the
    service's own flags; validated here first (ValueError), so a typo fails before any start."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    given = {name: getattr(args, name) for name in names if hasattr(args, name)}
    cls(**given)
    return {name: "none" if value is None else str(value) for name, value in given.items()}


def settings_from_args(args: argparse.Namespace) -> StackSettings:
    """Raises ValueError on an invalid engine setting."""
    scheduler_flags = engine_flags(args, SchedulerConfig)
    if args.summary_interval is not None:
        scheduler_flags["summary_interval"] = str(args.summary_interval)
    if args.max_retries is not None:
        scheduler_flags["max_retries"] = str(args.max_retries)
    worker_flags = engine_flags(args, WorkerConfig, WORKER_SKIP) if args.worker == "model" else {}
    tokenizer_flags = {"router_policy": args.router_policy} if args.router_policy else {}
    return StackSettings(
        model=args.model,
        worker=args.worker,
        sim_device=args.sim_device,
        sim_model=args.sim_model,
        frontend_address=args.frontend_addr,
        scheduler_flags=scheduler_flags,
        worker_flags=worker_flags,
        tokenizer_flags=tokenizer_flags,
        data_parallel_size=args.data_parallel_size,
        gateway=not args.no_gateway,
        http_host=args.http_host,
        http_port=args.http_port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        log_dir=args.log_dir,
        echo=None if args.quiet else ConsoleEcho(sys.stdout, _log_format(args.log_format)),
        echo_steps=args.show_steps,
        drain_timeout_s=args.drain_timeout,
        curve_keys=args.curve_keys,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def _log_format(requested: str) -> str:
    """The services always log JSON to files; this is only how our stdout shows them."""
    return resolve_log_format(requested, sys.stdout)


def cmd_up(args: argparse.Namespace) -> int:
    return cmd_demo(args, demo=False)


def cmd_demo(args: argparse.Namespace, demo: bool = True) -> int:
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"conveyor: {exc}", file=sys.stderr, flush=True)
        return 2
    refusal = exposure_refusal(settings)
    if refusal is not None:
        print(f"conveyor: refusing to start: {refusal}", file=sys.stderr, flush=True)
        return 2
    return run_stack(
        settings, args.ready_timeout, demo_prompt=args.prompt if demo else None,
        restart=args.restart,
    )  # fmt: skip


def exposure_refusal(settings: StackSettings) -> Optional[str]:
    """Why these settings would let other machines use the engine unauthenticated, or None.
    Without keys only loopback/ipc is bound: the frontend beyond loopback needs CURVE
    (--curve-keys), the HTTP gateway beyond loopback an API key. The internal sockets are ipc."""
    if settings.curve_keys is None and not is_local_address(settings.frontend_address):
        return (
            f"the frontend {settings.frontend_address} would be reachable from other machines "
            "without authentication; start with --curve-keys DIR (`conveyor keys generate "
            "DIR`, docs/protocol.md section 1.1) or bind a loopback address (tcp://127.0.0.1:PORT)"
        )
    if settings.gateway and settings.api_key is None and not is_loopback_host(settings.http_host):
        return (
            f"the HTTP gateway on {settings.http_host} would be reachable from other machines "
            "without an API key; pass --api-key KEY (CONVEYOR_API_KEY) or --http-host 127.0.0.1"
        )
    return None


def run_stack(
    settings: StackSettings,
    ready_timeout: float,
    demo_prompt: Optional[str] = None,
    restart: str = "on-failure",
) -> int:
    """Start, wait for ready, (demo), then serve until a signal or a service's death."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: Optional[FrameType]) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    stack = LocalStack(settings)
    try:
        stack.start()
        if not _wait_ready(stack, ready_timeout, stop):
            return 0 if stop.is_set() else 2
        if demo_prompt is not None:  # in a thread, so Ctrl-C is not held up by the answer
            asking = threading.Thread(
                target=_answer,
                args=(settings, stack.frontend_address, demo_prompt, stack.client_keys),
                daemon=True,
            )
            asking.start()
            while asking.is_alive() and not stop.wait(0.2):
                pass
        _say(settings, f"serving on {stack.frontend_address}"
             + (f" and {stack.http_url}" if stack.http_url else "")
             + f"; logs in {stack.log_dir}; Ctrl-C stops")  # fmt: skip
        return _serve(stack, stop, restart == "on-failure")
    finally:
        stack.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _wait_ready(stack: LocalStack, timeout: float, stop: threading.Event) -> bool:
    """True once ready; False on Ctrl-C (honoured even during a slow model load) or failure."""
    try:
        return stack.wait_ready(timeout=timeout, stop=stop)
    except StackError as exc:
        print(f"conveyor: the engine did not start: {exc}", file=sys.stderr, flush=True)
        return False


class _Backoff:
    """Delays before restarting each service (see FIRST_DELAY_S)."""

    def __init__(self) -> None:
        self._delay: dict[str, float] = {}
        self._started: dict[str, float] = {}

    def next_delay(self, name: str, now: float) -> float:
        stable = now - self._started.get(name, float("-inf")) > STABLE_S
        previous = self._delay.get(name)
        delay = FIRST_DELAY_S if stable or previous is None else min(previous * 2, MAX_DELAY_S)
        self._delay[name] = delay
        return delay

    def started(self, name: str, now: float) -> None:
        self._started[name] = now


def _serve(stack: LocalStack, stop: threading.Event, restart: bool) -> int:
    """Watch the services until a signal: a worker or scheduler that fails comes back after a
    back-off (when `restart`); any other death stops the engine (exit code 1)."""
    backoff = _Backoff()
    while not stop.wait(0.5):
        dead = stack.dead_service()
        if dead is None:
            continue
        name, rc = dead
        kind = "worker" if is_worker_rank(name) else name.split("-")[0]  # scheduler-1 too
        if restart and kind in RESTARTABLE and rc != 0:
            engine = stack.engine_of(name)
            group = f"{kind}@{engine}"  # ranks of one engine restart as one group
            delay = backoff.next_delay(group, time.monotonic())
            ranks = kind == "worker" and stack.settings.tensor_parallel_size > 1
            what = "its worker group" if ranks else "it"
            print(f"conveyor: {name} died (exit code {rc}); restarting {what} in {delay:g} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            if stop.wait(delay):
                return 0
            if kind == "worker" and engine is not None:
                stack.restart_workers(engine)
            else:
                stack.restart(name)
            backoff.started(group, time.monotonic())
            continue
        print(f"conveyor: {name} died (exit code {rc}); stopping the other services",
              file=sys.stderr, flush=True)  # fmt: skip
        stop.wait(DEATH_GRACE_S)  # the scheduler fails in-flight requests meanwhile
        return 1
    return 0


def _say(settings: StackSettings, text: str) -> None:
    """A message of the launcher's own, in the echo's format (plain when not echoing)."""
    if isinstance(settings.echo, ConsoleEcho):
        settings.echo.say(text)
    else:
        print(text, flush=True)


def _answer(
    settings: StackSettings, address: str, prompt: str, keys: tuple[Optional[Path], ...]
) -> None:
    """Ask the sample question and print the whole answer as one block (log lines from the
    services would otherwise interleave with a streamed answer)."""
    from shared.client import Client, EngineError

    server_key, client_key = keys
    with Client(address, timeout=300.0, server_key=server_key, client_key=client_key) as client:
        try:
            done = client.generate(messages=[{"role": "user", "content": prompt}],
                                   max_tokens=64, temperature=0.0)  # fmt: skip
        except EngineError as exc:
            print(f"conveyor: the sample prompt failed: {exc}", file=sys.stderr, flush=True)
            return
    seconds = done.timings.get("e2e_s") or 0.0
    _say(settings, f"\n> {prompt}\n{done.text.strip()}\n({done.usage.get('completion_tokens')} "
         f"tokens in {seconds:.1f} s)\n")  # fmt: skip
