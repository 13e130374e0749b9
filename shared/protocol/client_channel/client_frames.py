"""The client's side of the channel (used by shared/client): frames a client sends, and a
frontend reply read back as a map (the client core interprets its fields)."""

from __future__ import annotations

from typing import Any, Optional

import msgpack

from shared.protocol.client_channel.messages import PROTOCOL_VERSION
from shared.protocol.codec import DecodeError
from shared.protocol.errors import ErrorCode, short_repr


def encode_client_message(kind: str, id: Optional[str], **fields: Any) -> bytes:
    """A client message frame (used by shared/client); nil fields are left out."""
    present = {k: v for k, v in fields.items() if v is not None}
    wire = {"type": kind, "v": PROTOCOL_VERSION, **present}
    if id is not None:
        wire["id"] = id
    return msgpack.packb(wire, use_bin_type=True)


def decode_reply(frame: bytes) -> dict[str, Any]:
    """A frontend reply as a map; DecodeError when it is not one (a foreign peer)."""
    try:
        wire = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(
            ErrorCode.MALFORMED_MESSAGE, f"reply is not msgpack: {short_repr(str(exc))}"
        ) from None
    if not isinstance(wire, dict) or not isinstance(wire.get("type"), str):
        raise DecodeError(ErrorCode.MALFORMED_MESSAGE, "reply is not a map with a type")
    return wire
