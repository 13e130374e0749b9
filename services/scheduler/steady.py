"""Steady decodes: the running batch is unchanged since the last steps, so this step's decodes
are the last step's, and only the requests that reach a block boundary or their last token are
looked at (`Scheduler._schedule_decodes`, services/scheduler/scheduler.py).

While no request joins, leaves, is preempted or loses the worker (`RunningSet.version`
unchanged) and every step computes every running request (one decode token each), each
request's `num_computed_tokens` grows by exactly one per built step. The two per-request checks
of a decode — is its table full (grow it), is the sample in flight its last (skip it) — then
first become due at a build count known in advance: `due` maps that count to the requests to
check, and every other request is neither read nor written until its turn. A check that would
change the list (a request waits) ends the steady run: the step falls back to the full pass.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.scheduler.request import Request


@dataclass(slots=True)
class SteadyDecodes:
    decodes: list[Request]  # every running request, in batch order; read-only
    rids: list[str]  # their rids (the step record's list); read-only
    version: int  # `RunningSet.version` when it was made
    block_size: int
    num_builds: int = 0  # steps built since, each computing every one of `decodes`
    armed: bool = False  # the last step built was one of them: the next may reuse the list
    due: dict[int, list[Request]] = field(default_factory=dict)  # build number -> to check

    @classmethod
    def start(cls, decodes: list[Request], version: int, block_size: int) -> SteadyDecodes:
        """Made by a full pass that scheduled every running request as a decode (before the
        step is built: the next build is number 1)."""
        steady = cls(list(decodes), [r.rid for r in decodes], version, block_size)
        for req in decodes:
            steady.check_later(req, 1)
        return steady

    def check_later(self, req: Request, build: int) -> None:
        """`req` was checked for build number `build` (its computed count as of now, before
        that build): file it under the first later build at which a check may say otherwise.
        Its computed count at build b is the present one plus b - build."""
        computed = req.num_computed_tokens
        to_boundary = len(req.block_ids) * self.block_size - computed  # >= 1 once checked
        to_last = req.max_len - 1 - computed  # computed + 1 >= max_len from here on
        at = build + max(1, min(to_boundary, to_last))
        bucket = self.due.get(at)
        if bucket is None:
            self.due[at] = [req]
        else:
            bucket.append(req)

    def take_due(self) -> tuple[int, list[Request]]:
        """The next build's number and the requests to check for it. Disarms: only a built
        step that computed the whole list re-arms it (`built`)."""
        self.armed = False
        build = self.num_builds + 1
        return build, self.due.pop(build, [])

    def built(self) -> None:
        """The step just built computed every request of the list."""
        self.num_builds += 1
        self.armed = True


@dataclass(slots=True)
class SteadyTokens:
    """`update`'s side of a steady run: results of steady plans over one unchanged list of
    samplers (`sampled`, the worker view's shared list), each appending one token to every one
    of them. While no token can end a request — none is a stop id of any of them, and every
    request has more than one token left before its length limit — a result is appended in C
    (`list.append` mapped over the token lists), with no per-request check in Python.

    Valid only while every token the samplers get comes through `StepResults._apply_steady`
    (the general path of `update` drops it)."""

    sampled: list[Request]  # the list it was made for: compared by identity
    token_lists: list[list[int]]  # each sampler's token_ids (the same list objects)
    stop_ids: frozenset[int]  # every sampler's stop ids together
    min_left: int  # the fewest tokens any sampler may still append before its length limit

    @classmethod
    def of(cls, sampled: list[Request]) -> SteadyTokens:
        token_lists = [r.token_ids for r in sampled]
        stop_ids = frozenset().union(*(r.stop_ids for r in sampled))
        min_left = min((r.max_len - len(r.token_ids) for r in sampled), default=0)
        return cls(sampled, token_lists, stop_ids, min_left)

    def append_if_none_ends(self, token_ids: list[int]) -> bool:
        """Append one result's tokens (one per sampler, in order) when none of them can end its
        request; False (nothing appended) otherwise."""
        if self.min_left <= 1 or not self.stop_ids.isdisjoint(token_ids):
            return False
        deque(map(list.append, self.token_lists, token_ids), maxlen=0)
        self.min_left -= 1
        return True
