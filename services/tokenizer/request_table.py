"""The frontend's open requests: by the rid of their current attempt on an engine, and by
(connection, client id) with a count per connection.

A request is open from the moment an engine took it until its terminal reply: the request flow
(request_flow.py) `add`s it at admission and `pop`s it once it ends, whichever way; the
resumption (resumption.py) `rekey`s it when it moves to its next attempt; everyone else only
reads. The output path looks a request up once per token (`get`), by the rid the engine sends:
an earlier attempt's rid finds nothing (fencing).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, KeysView
from typing import Optional

from services.tokenizer.request_state import ClientRequest


class RequestTable:
    """Open requests. Invariants (`check_invariants`): each open request is listed once under
    its rid and once under its (connection, client id); a connection's count is the number of
    its open requests, and only connections with an open request are counted."""

    def __init__(self) -> None:
        self._by_rid: dict[str, ClientRequest] = {}
        self._by_client: dict[tuple[bytes, str], str] = {}  # (identity, client id) -> rid
        self._num_per_conn: Counter[bytes] = Counter()  # identity -> requests in flight
        # The dict's own lookup, bound once: the output path calls it for every token.
        self.get: Callable[[str], Optional[ClientRequest]] = self._by_rid.get

    def add(self, state: ClientRequest) -> None:
        """Called at admission, once the request's engine took it."""
        self._by_rid[state.engine_rid] = state
        self._by_client[(state.identity, state.client_id)] = state.engine_rid
        self._num_per_conn[state.identity] += 1

    def rekey(self, state: ClientRequest, old_rid: str) -> None:
        """Called when the request moved to its next attempt (its `engine_rid` changed from
        `old_rid`): from now on only the new attempt's outputs find it."""
        del self._by_rid[old_rid]
        self._by_rid[state.engine_rid] = state
        self._by_client[(state.identity, state.client_id)] = state.engine_rid

    def pop(self, rid: str) -> ClientRequest:
        """Called once the request ended (any way), with its current attempt's rid; KeyError
        when it is not open."""
        state = self._by_rid.pop(rid)
        self._by_client.pop((state.identity, state.client_id), None)
        self._num_per_conn[state.identity] -= 1
        if self._num_per_conn[state.identity] <= 0:
            del self._num_per_conn[state.identity]
        return state

    def __len__(self) -> int:
        return len(self._by_rid)

    def __contains__(self, rid: object) -> bool:
        return rid in self._by_rid

    def __iter__(self) -> Iterator[ClientRequest]:
        """The open requests, oldest first (admission order)."""
        return iter(self._by_rid.values())

    def rid_of(self, identity: bytes, client_id: str) -> Optional[str]:
        """The open request a client calls `client_id` on its connection, if any."""
        return self._by_client.get((identity, client_id))

    def num_on(self, identity: bytes) -> int:
        """Requests in flight on one connection (the per-connection cap)."""
        return self._num_per_conn[identity]

    def rids_of(self, identity: bytes) -> list[str]:
        """The open requests of one connection."""
        return [rid for (owner, _), rid in self._by_client.items() if owner == identity]

    def rids_on(self, engine: Optional[int]) -> list[str]:
        """The open requests running on engine `engine` (None: waiting for one), oldest
        first."""
        return [rid for rid, state in self._by_rid.items() if state.engine == engine]

    def rids(self) -> list[str]:
        """Every open request's rid, oldest first (a copy: safe to pop while walking it)."""
        return list(self._by_rid)

    def connections(self) -> KeysView[bytes]:
        """The connections (client identities) with at least one open request."""
        return self._num_per_conn.keys()

    def check_invariants(self) -> None:
        """Read-only; raises AssertionError when the indexes disagree (and checks each open
        request's own invariants)."""
        assert len(self._by_client) == len(self._by_rid), (self._by_client, list(self._by_rid))
        for (identity, client_id), rid in self._by_client.items():
            state = self._by_rid.get(rid)
            assert state is not None, f"client id {client_id!r} maps to a closed request {rid}"
            assert (state.identity, state.client_id) == (identity, client_id), rid
        counts = Counter(state.identity for state in self._by_rid.values())
        assert counts == self._num_per_conn, (counts, self._num_per_conn)
        for rid, state in self._by_rid.items():
            assert state.engine_rid == rid
            state.check_invariants()
