"""Routing one step's outputs to the frontends that own them.

Every live rid belongs to the frontend that submitted it (`owners`: rid -> that frontend's
ROUTER identity); tokens never go to another frontend. Called by the server after the next plan
has left, so this work sits off the result -> plan path.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.protocol.engine_channel import OutputBatch, RequestOutput


def split_by_frontend(
    batch: OutputBatch,
    owners: dict[str, bytes],
    on_finished: Callable[[RequestOutput], None],
) -> dict[bytes, OutputBatch]:
    """Each owning frontend's part of `batch`. Finished rids leave `owners` (their frontend
    hears the final output once; `on_finished` is called for each); outputs of rids without an
    owner (their frontend is gone) are dropped."""
    groups: dict[bytes, tuple[list[str], list[int], list[RequestOutput], list[RequestOutput]]] = {}
    idents = set(map(owners.get, batch.rids))  # in C: one frontend is the common case
    if len(idents) == 1 and None not in idents:  # the columns go whole to that one
        groups[idents.pop()] = (batch.rids, batch.token_ids, [], [])  # shared, read-only
    elif idents:
        _group_columns(batch, owners, groups)
    for out in batch.multi:  # several tokens of a request that goes on (speculation)
        owner = owners.get(out.rid)
        if owner is not None:
            groups.setdefault(owner, ([], [], [], []))[3].append(out)
    for out in batch.finished:
        owner = owners.pop(out.rid, None)
        if owner is None:
            continue
        groups.setdefault(owner, ([], [], [], []))[2].append(out)
        on_finished(out)
    parts = {}
    for ident, (rids, token_ids, finished, multi) in groups.items():
        logprobs = batch.logprobs
        if logprobs:
            logprobs = {rid: logprobs[rid] for rid in rids if rid in logprobs}
        parts[ident] = OutputBatch(batch.step_id, rids, token_ids, logprobs, finished, multi)
    return parts


def _group_columns(
    batch: OutputBatch,
    owners: dict[str, bytes],
    groups: dict[bytes, tuple[list[str], list[int], list[RequestOutput], list[RequestOutput]]],
) -> None:
    """Several frontends (or rids whose frontend is gone): each owner's entries, in order."""
    for rid, token in zip(batch.rids, batch.token_ids, strict=True):
        owner = owners.get(rid)
        if owner is None:
            continue
        group = groups.get(owner)
        if group is None:
            group = groups[owner] = ([], [], [], [])
        group[0].append(rid)
        group[1].append(token)
