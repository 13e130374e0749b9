"""`conveyor generate`, `conveyor chat`, `conveyor stats`, `conveyor drain`: thin commands over
the client.

With no `--address`, they reach the engine `conveyor up` started (tcp://127.0.0.1:5557, or
CONVEYOR_FRONTEND_ADDR). Engine errors and an unreachable engine go to stderr with exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from shared.addresses import default_frontend_address
from shared.curve import add_client_key_flags

EXIT_ENGINE_ERROR = 1


def add_client_commands(sub: Any) -> None:
    gen = sub.add_parser("generate", help="raw completion (no chat template), streamed")
    gen.add_argument("prompt")
    _add_sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", help="a system message (else the template's default)")
    _add_sampling_flags(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)
    stats = sub.add_parser("stats", help="frontend and engine counters as JSON")
    _add_address(stats)
    stats.set_defaults(func=cmd_stats)
    drain = sub.add_parser("drain", help="take an engine out for maintenance: its requests "
                           "move to the other engines (docs/RELIABILITY.md)")  # fmt: skip
    drain.add_argument("--engine", required=True, help="the engine's name, as in `health`")
    drain.add_argument("--undo", action="store_true", help="let the engine admit again")
    drain.add_argument(
        "--wait",
        type=float,
        default=120.0,
        help="seconds to wait until the engine holds no request (0: do not)",
    )
    _add_address(drain)
    drain.set_defaults(func=cmd_drain)


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=default_frontend_address(),
                   help="the frontend (default: what `conveyor up` starts)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds without a word from the engine before giving up")  # fmt: skip
    add_client_key_flags(p)


def _client(args: argparse.Namespace) -> Any:
    """The command's Client; bad key files end the command with exit code 2."""
    from shared.client import Client

    try:
        return Client(args.address, timeout=args.timeout, server_key=args.server_key,
                      client_key=args.client_key)  # fmt: skip
    except ValueError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        sys.exit(2)


def _add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int = 16) -> None:
    _add_address(p)
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--usage", action="store_true", help="print usage and timings to stderr")


def _params(args: argparse.Namespace) -> dict[str, Any]:
    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop")
    params = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.ignore_eos:
        params["ignore_eos"] = True
    return params


def cmd_generate(args: argparse.Namespace) -> int:
    from shared.client import EngineError

    try:
        with _client(args) as client:
            stream = client.stream(args.prompt, priority=args.priority, **_params(args))
            for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            if args.usage and stream.done is not None:
                _print_usage(stream.done)
    except EngineError as exc:
        print(f"conveyor: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_ENGINE_ERROR
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from shared.client import EngineError

    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("chat: an empty line or Ctrl-D ends it", file=sys.stderr)
    with _client(args) as client:
        while True:
            try:
                line = input("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                break
            if not line:
                break
            messages.append({"role": "user", "content": line})
            reply = []
            try:
                for chunk in client.stream(messages=messages, priority=args.priority,
                                           **_params(args)):  # fmt: skip
                    print(chunk.text, end="", flush=True)
                    reply.append(chunk.text)
            except EngineError as exc:
                print(f"\nconveyor: {exc.code}: {exc.message}", file=sys.stderr)
                messages.pop()
                continue
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from shared.client import EngineError

    try:
        with _client(args) as client:
            print(json.dumps(client.stats(), indent=2, sort_keys=True))
    except EngineError as exc:
        print(f"conveyor: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_ENGINE_ERROR
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    """Drain (or undo): then wait until the engine holds no live request. Exit 0 when it is
    empty (or was undone), 1 on an engine error or when it still holds requests."""
    from shared.client import EngineError

    try:
        with _client(args) as client:
            reply = client.drain(args.engine, drain=not args.undo)
            print(json.dumps({k: reply.get(k) for k in ("engine", "draining", "num_moved")}))
            if args.undo or args.wait <= 0:
                return 0
            return 0 if _wait_empty(client, args.engine, args.wait) else EXIT_ENGINE_ERROR
    except EngineError as exc:
        print(f"conveyor: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_ENGINE_ERROR


def _wait_empty(client: Any, engine: str, wait_s: float) -> bool:
    """Poll the engine's stats until it holds no live request (True) or `wait_s` passed."""
    deadline = time.monotonic() + wait_s
    while True:
        stats = (client.stats().get("engines") or {}).get(engine) or {}
        live = stats.get("num_live_requests")
        if live == 0:
            print(json.dumps({"engine": engine, "drained": True}))
            return True
        if time.monotonic() > deadline:
            print(f"conveyor: engine {engine} still holds {live} requests", file=sys.stderr)
            return False
        time.sleep(0.5)


def _print_usage(done: Any) -> None:
    print(json.dumps({"finish_reason": done.finish_reason, "usage": done.usage,
                      "timings": done.timings}), file=sys.stderr)  # fmt: skip
