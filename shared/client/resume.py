"""What a client needs to resume its requests on another (or a restarted) frontend.

The frontend holds a request's tokens while it lives; when the frontend itself is lost, only
the client holds them. So the client keeps, per open `generate`, the fields it sent and every
token id and the text its chunks brought, and on a new connection sends each one again with
`resume` (docs/protocol.md §5.1): the new frontend goes on after those tokens, with the same
seed and output index, so the stream continues with no chunk lost or repeated. A request with
no chunk yet (or not streamed) is sent again as it was. A sampled request without a seed gets
one here, when it is first sent: its continuation elsewhere then draws the same tokens.

One owner (ClientCore); no I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

from shared.client.types import generate_frame
from shared.protocol.sampling import GREEDY_TEMPERATURE_FLOOR

DEFAULT_MAX_RESUMES = 3  # resumptions of one request after a lost frontend, then an error
RETRY_S = 0.5  # a resumed request the new frontend is not ready for is sent again after this


@dataclass
class OpenGenerate:
    """One `generate` sent and not ended: its fields, and what its chunks brought so far."""

    fields: dict[str, Any]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_resumes: int = 0
    # after a resumption, until this (monotonic) time a `not_ready` answer means "not yet" (a
    # restarted frontend has not heard its engines yet): sent again at `retry_at`
    retry_until: float = 0.0
    retry_at: Optional[float] = None


class OpenRequests:
    """The client's requests a new connection must send again: generates (resumed) and
    queries (asked again). Invariant: an id is open here from its first send until its end
    (done, error, or given up)."""

    def __init__(self, max_frame_bytes: int, max_resumes: int = DEFAULT_MAX_RESUMES) -> None:
        self._max_frame_bytes = max_frame_bytes
        self._max_resumes = max_resumes
        self._generates: dict[str, OpenGenerate] = {}
        self._queries: dict[str, bytes] = {}  # query id -> its frame
        self._aborts: dict[str, bytes] = {}  # id -> its `abort` frame, until `aborted`

    def __len__(self) -> int:
        return len(self._generates) + len(self._queries) + len(self._aborts)

    def aborting(self, rid: str, frame: bytes) -> None:
        """An `abort` was sent: a new connection sends it again (after the request itself,
        which it resumes) until `aborted` comes."""
        self._aborts[rid] = frame

    def opened(self, rid: str, fields: Optional[dict[str, Any]], frame: bytes) -> None:
        """A request (`fields`: a generate's) or a query (`fields` None) was sent."""
        if fields is None:
            self._queries[rid] = frame
        else:
            self._generates[rid] = OpenGenerate(fields)

    def on_reply(self, rid: str, msg: dict[str, Any], now: float) -> bool:
        """Every reply of an open id: chunks add to what a resumption carries; a terminal
        reply ends it here. False when the reply is not for the caller: a resumed request
        that the new frontend is not ready for yet, to send again (`due_frames`)."""
        open_gen = self._generates.get(rid)
        kind = msg.get("type")
        if open_gen is not None and kind == "error" and msg.get("code") == "not_ready":
            if now < open_gen.retry_until:
                open_gen.retry_at = now + RETRY_S
                return False
        if kind == "aborted":
            self._aborts.pop(rid, None)
        elif open_gen is not None and kind == "chunk":
            open_gen.token_ids.extend(t for t in msg.get("token_ids") or [] if type(t) is int)
            text = msg.get("text")
            open_gen.text += text if isinstance(text, str) else ""
        elif kind in ("done", "error") or rid in self._queries:
            self.closed(rid)
        return True

    def due_frames(self, now: float) -> list[tuple[str, bytes]]:
        """(id, frame) of the resumed requests to send again now (see `on_reply`)."""
        due = []
        for rid, gen in self._generates.items():
            if gen.retry_at is not None and gen.retry_at <= now:
                gen.retry_at = None
                due.append((rid, self._frame(rid, gen)))
        return due

    def retrying(self) -> bool:
        """Whether a resumed request waits to be sent again."""
        return any(gen.retry_at is not None for gen in self._generates.values())

    def _frame(self, rid: str, gen: OpenGenerate) -> bytes:
        fields = dict(gen.fields)
        if gen.token_ids:
            fields["resume"] = {"token_ids": gen.token_ids, "text": gen.text}
        return generate_frame(rid, fields, self._max_frame_bytes)

    def closed(self, rid: str) -> None:
        """It ended, or was given up: a new connection does not send it again."""
        self._generates.pop(rid, None)
        self._queries.pop(rid, None)

    def resume_frames(
        self, now: float, window_s: float
    ) -> tuple[list[tuple[str, bytes]], list[str]]:
        """For a new connection: (id, frame) to send for each open request, and the ids that
        resumed too often already (the caller fails them). For `window_s` from `now` a
        `not_ready` answer to one of them sends it again later."""
        frames: list[tuple[str, bytes]] = list(self._queries.items())
        exhausted = []
        for rid, gen in list(self._generates.items()):
            gen.num_resumes += 1
            if gen.num_resumes > self._max_resumes:
                exhausted.append(rid)
                self.closed(rid)
                continue
            gen.retry_until, gen.retry_at = now + window_s, None
            frames.append((rid, self._frame(rid, gen)))
        frames += list(self._aborts.items())
        return frames, exhausted

    def forget_abort(self, rid: str) -> None:
        """The caller stopped waiting for `rid`'s `aborted`."""
        self._aborts.pop(rid, None)

    def check_invariants(self) -> None:
        """Read-only; an id is never both a generate and a query."""
        assert not set(self._generates) & set(self._queries)


def pin_seed(params: dict[str, Any]) -> dict[str, Any]:
    """`params` with a seed when the request samples and has none (a random 63-bit one):
    its resumption on another frontend then draws the same tokens."""
    if params.get("seed") is not None:
        return params
    temperature = params.get("temperature")
    greedy = isinstance(temperature, (int, float)) and temperature < GREEDY_TEMPERATURE_FLOOR
    return params if greedy else {**params, "seed": random.getrandbits(63)}
