"""The protocol-level Python client (docs/protocol.md), sync and asyncio.

The CLI, the HTTP gateway and the benchmark all use it; `conveyor` re-exports it.
"""

from shared.client.async_client import AsyncClient, AsyncStream
from shared.client.sync_client import DEFAULT_ADDRESS, Client, Stream
from shared.client.types import Chunk, Completion, Done, Embedding, EngineError

__all__ = [
    "DEFAULT_ADDRESS",
    "AsyncClient",
    "AsyncStream",
    "Chunk",
    "Client",
    "Completion",
    "Done",
    "Embedding",
    "EngineError",
    "Stream",
]
