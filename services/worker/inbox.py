"""The scheduler's frames to a worker, read in order by the worker loop (services/worker/loop.py),
with one exception: the KV hand-over's messages may be taken out early.

A simulated prefill worker that answers KV reads during its steps (one-sided reads,
services/worker/sim/kv_link.py) must also learn of a lease while a step runs: its `GrantLease`
waits on the plan socket behind the next plan. `take_handover` reads every frame waiting, hands
`GrantLease`, `EndLease` and `PullKv` to the KV transfer at once and holds the rest, in order, for
the loop. That is safe: a grant follows the result of the step that computed its blocks; an end
only refuses reads sooner (the blocks are reused only by plans after it); a pull's blocks are
its own. The real worker never calls it (a Python step cannot be interrupted): for it the inbox
is the socket.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Optional

import zmq

from shared.protocol.codec import DecodeError, decode
from shared.protocol.worker_channel import EndLease, GrantLease, PullKv

HANDOVER_MESSAGES = (GrantLease, EndLease, PullKv)


class PlanInbox:
    """Owns the frames read from the plan socket ahead of the loop (in arrival order)."""

    def __init__(self, sock: zmq.Socket, max_frame_bytes: Optional[int] = None) -> None:
        self.sock = sock
        self._max_frame_bytes = max_frame_bytes
        self._held: deque[bytes] = deque()

    def ready(self, events: dict[Any, int]) -> bool:
        """Whether a frame waits for the loop (held here, or on the socket per `events`)."""
        return bool(self._held) or self.sock in events

    def wait_ms(self, longest_ms: int) -> int:
        """0 while frames are held (the loop must not sleep on a socket already drained)."""
        return 0 if self._held else longest_ms

    def recv(self) -> bytes:
        """The next frame in order; called when `ready`."""
        return self._held.popleft() if self._held else self.sock.recv()

    def take_handover(self, handle: Callable[[Any], None]) -> None:
        """Read every frame waiting; the hand-over's messages go to `handle` now, the others
        are held for the loop."""
        while self.sock.poll(0, zmq.POLLIN):
            frame = self.sock.recv()
            try:
                msg = decode(frame, max_size=self._max_frame_bytes)
            except DecodeError:
                msg = None  # the loop reports it, in its place
            if isinstance(msg, HANDOVER_MESSAGES):
                handle(msg)
            else:
                self._held.append(frame)
