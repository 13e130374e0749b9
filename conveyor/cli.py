"""`conveyor` (and `python -m conveyor`): the command line.

conveyor up [engine flags]        start the stack, show every service's log, Ctrl-C stops it
conveyor demo                     up + answer one sample prompt, then keep serving
conveyor generate "text" ...      raw completion streamed to stdout
conveyor chat                     interactive chat with the model's chat template
conveyor stats                    the frontend's and the engine's counters (JSON)
conveyor drain --engine I         move engine I's requests elsewhere, stop admitting to it
conveyor top                      a live view of running engines (q quits)
conveyor logs --rid ID            one request's journey across the services
conveyor model prepare [MODEL]    convert the model once into the cache
conveyor keys generate DIR        CURVE key pairs for every ZeroMQ link (docs/protocol.md)
conveyor bench ... / conveyor sim ...   the benchmark harness and the simulator
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Optional

from conveyor.client_cmds import add_client_commands
from conveyor.logview import add_logs_command
from conveyor.top import add_top_command
from conveyor.up import add_up_commands
from shared.addresses import default_frontend_address
from shared.env import env_str

PASSTHROUGH = {"bench": "conveyor.bench.cli", "sim": "conveyor.sim_cli"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor",
        description="Conveyor: a continuous-batching LLM serving engine.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_up_commands(sub)
    add_client_commands(sub)
    add_logs_command(sub)
    add_top_command(sub)
    model = sub.add_parser("model", help="model files")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    prep = model_sub.add_parser("prepare", help="convert the model into the cache once")
    prep.add_argument("model", nargs="?", default=env_str("MODEL"),
                      help="'smollm2' (default), a .gguf file or an HF folder")  # fmt: skip
    prep.set_defaults(func=_model_prepare)
    keys = sub.add_parser("keys", help="CURVE keys of the client protocol")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    gen = keys_sub.add_parser(
        "generate", help="a server key pair, client/worker/frontend key pairs, authorized_*/"
    )
    gen.add_argument("dir", type=Path, help="where the key files go (created)")
    gen.add_argument("--keep-existing", action="store_true",
                     help="a folder that already has keys is kept as it is (exit 0)")  # fmt: skip
    gen.set_defaults(func=_keys_generate)
    for name in PASSTHROUGH:
        sub.add_parser(name, help=f"`conveyor {name} --help` for its own flags", add_help=False)
    return parser


def default_address() -> str:
    """The frontend `conveyor up` starts by default (or CONVEYOR_FRONTEND_ADDR)."""
    return default_frontend_address()


def _model_prepare(args: argparse.Namespace) -> int:
    from shared.model_files import prepare_model

    folder: Path = prepare_model(args.model)
    print(folder)
    _build_cpu_kernels()
    return 0


def _build_cpu_kernels() -> None:
    """Compile the worker's C++ CPU kernels once for this machine (cached; the first worker
    start would do it otherwise). A failure is reported, not fatal: the worker falls back to
    torch, and tests/kernels/test_cpu_ext.py fails on machines that should build it."""
    from services.worker.ops_cpu import build_cpu_ext

    error = build_cpu_ext()
    if error is not None:
        print(f"warning: the C++ CPU kernels did not build (torch fallback): {error}",
              file=sys.stderr)  # fmt: skip


def _keys_generate(args: argparse.Namespace) -> int:
    from shared.curve import client_secret_path, generate_keys, server_public_path

    try:
        written = generate_keys(args.dir)
    except FileExistsError as exc:
        print(f"conveyor keys: {exc}", file=sys.stderr)
        return 0 if args.keep_existing else 1
    for path in written:
        print(path)
    print(
        f"start the engine with --curve-keys {args.dir}; clients use "
        f"--server-key {server_public_path(args.dir)} --client-key "
        f"{client_secret_path(args.dir)}",
        file=sys.stderr,
    )
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH:  # their own parsers own every flag after the name
        module = importlib.import_module(PASSTHROUGH[argv[0]])
        return int(module.main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
