"""`python -m services.tokenizer`: the frontend process (flags, else CONVEYOR_* variables).

Keeps to one thread (no torch; the tokenizer's own thread pool is switched off) so that the
worker has the cores. SIGTERM or SIGINT drains: new requests get `shutting_down`, in-flight ones
may finish within the grace period, then the scheduler hears FrontendBye and the process exits.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Optional

import zmq

from services.tokenizer.config import parse_args
from services.tokenizer.server import FrontendServer
from services.tokenizer.text_codec import load_text_codec
from shared.curve import start_authenticator, stop_authenticator
from shared.logging import configure_logging
from shared.model_files import prepare_model
from shared.tracing import start_tracing


def main(argv: Optional[list[str]] = None) -> int:
    # Read by `tokenizers` when it first encodes, not at import: one thread from here on.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config, logs = parse_args(argv)
    log = configure_logging("tokenizer", logs.log_level, logs.log_file, log_format=logs.log_format)
    log.info("loading_tokenizer", model=config.model or "smollm2")
    try:
        codec = load_text_codec(prepare_model(config.model))
    except ValueError as exc:
        log.error("model_failed", error=str(exc))
        return 2
    context = zmq.Context.instance()
    tracing = start_tracing("tokenizer", logs.otlp_endpoint, log)
    server = FrontendServer(config, codec, log, context, tracing)

    def on_signal(signum: int, _frame: Optional[FrameType]) -> None:
        log.info("signal", signal=signal.Signals(signum).name)
        server.request_drain()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The ZAP handler admitting only authorized_clients (none without --curve-keys): it runs
    # in this context for as long as the client socket is open.
    auth = start_authenticator(context, config.curve_keys, log)
    try:
        server.open()
    except zmq.ZMQError as exc:
        log.error("bind_failed", address=config.frontend_address, error=exc.strerror)
        return 2
    else:
        return server.run()
    finally:
        stop_authenticator(auth)
        if tracing is not None:
            tracing.shutdown()


if __name__ == "__main__":
    sys.exit(main())
