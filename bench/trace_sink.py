"""A benchmark's tracing: spans exported over OTLP/HTTP to a sink thread in the same process
that answers 200 and reads nothing (what a collector costs is not the benchmarked path's; the
export thread's cost in the process is)."""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from shared.tracing import Tracing

_TRACING: Optional[Tracing] = None


class _Sink(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def sink_tracing() -> Tracing:
    """The run's one Tracing (made on first use, with its sink)."""
    global _TRACING
    if _TRACING is None:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        _TRACING = Tracing("bench", f"127.0.0.1:{server.server_address[1]}")
    return _TRACING


def main() -> None:
    """`python -m bench.trace_sink PORT`: a sink on 127.0.0.1:PORT until killed (for
    `conveyor bench --compare otlp_endpoint=none,127.0.0.1:PORT`)."""
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), _Sink)
    server.serve_forever()


if __name__ == "__main__":
    main()
