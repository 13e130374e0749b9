"""`python -m services.gateway`: the OpenAI-compatible HTTP gateway, one asyncio process."""

from __future__ import annotations

import sys
from typing import Optional

import uvicorn

from services.gateway.app import create_app
from services.gateway.config import parse_args
from shared.logging import configure_logging
from shared.tracing import start_tracing


def main(argv: Optional[list[str]] = None) -> int:
    config, logs = parse_args(argv)
    log = configure_logging("gateway", logs.log_level, logs.log_file, log_format=logs.log_format)
    app = create_app(config, log, start_tracing("gateway", logs.otlp_endpoint, log))
    log.info(
        "gateway_start",
        http_host=config.http_host,
        http_port=config.http_port,
        engine_addr=config.engine_addr,
        model=config.served_model_name,
        auth=config.requires_key,
    )
    # Our own JSON log lines (one per request, with rid) replace uvicorn's access log and its
    # plain-text lifecycle lines; uvicorn's warnings and errors still reach stderr.
    uvicorn.run(
        app,
        host=config.http_host,
        port=config.http_port,
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=5,
    )
    log.info("gateway_stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
