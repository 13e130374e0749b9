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
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal, Optional

from conveyor.console import ConsoleEcho
from conveyor.launcher import LocalStack, StackError, StackSettings, is_worker_rank
from shared.addresses import is_local_address, is_loopback_host
from shared.config_flags import add_config_flags, build_config
from shared.env import LogConfig
from shared.logging import resolve_log_format

SAMPLE_PROMPT = "What is continuous batching in LLM serving? Answer in two sentences."
DEATH_GRACE_S = 3.0  # a dead service, not restarted: let the others fail requests first
# what `--restart on-failure` brings back: the frontend (clients and the gateway resume their
# streams on it), the scheduler (the frontend resumes its requests on it), and the worker
# ranks (always as a whole group: see LocalStack.restart_workers)
RESTARTABLE = ("tokenizer", "scheduler", "worker")
# Back-off between restarts of one service: 0.5 s, doubling up to 10 s; a service that stayed up
# for STABLE_S starts again from the shortest delay.
FIRST_DELAY_S, MAX_DELAY_S, STABLE_S = 0.5, 10.0, 30.0


@dataclass(frozen=True, slots=True)
class UpOptions:
    """`conveyor up`'s own options; what it starts is StackSettings (its flags too)."""

    ready_timeout_s: float = field(
        default=600.0, metadata={"help": "seconds the engine may take to become ready"}
    )
    restart: Literal["on-failure", "no"] = field(
        default="on-failure",
        metadata={"help": "restart a worker or scheduler that exits with an error, with "
                  "back-off (no: its death stops the engine)"},
    )  # fmt: skip
    quiet: bool = field(default=False, metadata={"help": "logs to files only, not to stdout"})
    # how our stdout shows the services' lines (their log files are JSON whatever it says)
    echo: LogConfig = field(
        default_factory=LogConfig, metadata={"skip": ("log_level", "log_file", "otlp_endpoint")}
    )


@dataclass(frozen=True, slots=True)
class DemoOptions:
    prompt: str = field(default=SAMPLE_PROMPT, metadata={"help": "the question to answer"})


def add_up_commands(sub: Any) -> None:
    up = sub.add_parser("up", help="start tokenizer, scheduler, worker (and gateway)")
    _add_stack_flags(up)
    up.set_defaults(func=cmd_up)
    demo = sub.add_parser("demo", help="up + answer a sample prompt, keep serving until Ctrl-C")
    _add_stack_flags(demo)
    add_config_flags(demo, DemoOptions)
    demo.set_defaults(func=cmd_demo)


def _add_stack_flags(p: argparse.ArgumentParser) -> None:
    """Every field of StackSettings (the services' configs nested in it) and of UpOptions."""
    add_config_flags(p, StackSettings)
    add_config_flags(p, UpOptions)


def settings_from_args(args: argparse.Namespace) -> StackSettings:
    """The stack `up` starts, from its flags (else CONVEYOR_* variables, else the configs'
    defaults). Raises ValueError on an invalid setting, before anything starts."""
    options = build_config(UpOptions, args)
    settings = build_config(StackSettings, args)
    echo = None if options.quiet else ConsoleEcho(sys.stdout, _log_format(options.echo.log_format))
    return dataclasses.replace(settings, echo=echo)


def _log_format(requested: str) -> str:
    """The services always log JSON to files; this is only how our stdout shows them."""
    return resolve_log_format(requested, sys.stdout)


def cmd_up(args: argparse.Namespace) -> int:
    return cmd_demo(args, demo=False)


def cmd_demo(args: argparse.Namespace, demo: bool = True) -> int:
    try:
        settings = settings_from_args(args)
        options = build_config(UpOptions, args)
        prompt = build_config(DemoOptions, args).prompt if demo else None
    except ValueError as exc:
        print(f"conveyor: {exc}", file=sys.stderr, flush=True)
        return 2
    refusal = exposure_refusal(settings)
    if refusal is not None:
        print(f"conveyor: refusing to start: {refusal}", file=sys.stderr, flush=True)
        return 2
    return run_stack(settings, options.ready_timeout_s, prompt, options.restart)


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
    http = settings.gateway_config
    if settings.gateway and not http.requires_key and not is_loopback_host(http.http_host):
        return (
            f"the HTTP gateway on {http.http_host} would be reachable from other machines "
            "without an API key; pass --api-key KEY (CONVEYOR_API_KEY), --api-key-file FILE or "
            "--http-host 127.0.0.1"
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
