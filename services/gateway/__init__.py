"""The OpenAI-compatible HTTP gateway: just another client of the engine (docs/gateway.md)."""
