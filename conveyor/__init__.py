"""Conveyor: a continuous-batching LLM serving engine (tokenizer, scheduler, workers over ZeroMQ).

The protocol-level client lives in `shared.client` (the gateway and the CLI use it too); it is
re-exported here, imported on first use so `conveyor` itself stays light:

    from conveyor import Client
    print(Client().generate("Once upon a time", max_tokens=20, temperature=0).text)
"""

from __future__ import annotations

from typing import Any

__all__ = ["AsyncClient", "Chunk", "Client", "Completion", "EngineError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import shared.client

        return getattr(shared.client, name)
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
