"""Step compositions: which work goes into the next forward (`--step-composition`).

Prefill (compute-bound, many tokens per sequence) and decode (one token each, bound by reading
the weights and the KV cache) can share a forward or take turns. The seeds' three answers, each
one small policy object the step filler asks at the start of every step (`forwards()`) and tells
what was built (`built()`):

* `mixed` (default): one forward holds every running decode and as many prompt chunks as the
  token budget leaves (chunked prefill beside decodes, vLLM's and Sarathi's way);
* `prefill-first`: SGLang's loop: when prompt work can be scheduled (a prompt mid-way, or a
  waiting request that can be admitted) the forward is prefill-only, under the whole budget;
  otherwise it is decode-only. Decodes wait while prompts arrive;
* `decode-first`: the `PrefillDecodeScheduler` of the seeds: every iteration runs the decodes
  in a forward of their own, then the prompts in a SEPARATE forward, within what the decodes
  left of the budget and at most `max_prefill_chunks` chunks, so a prompt never lengthens the
  decode forward.

A forward is one plan (docs/design/step_contract.md): a decode-first iteration is two plans, a
decode plan and then a prompt plan in which the held decodes compute nothing. `Forward` says
what one may hold; `forwards()` lists the kinds this step may be, in order of preference, and
the filler takes the first that schedules anything (services/scheduler/fill.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, Optional, get_args

StepCompositionName = Literal["mixed", "prefill-first", "decode-first"]
STEP_COMPOSITIONS: tuple[str, ...] = get_args(StepCompositionName)


@dataclass(frozen=True, slots=True)
class Forward:
    """What one forward may hold."""

    decodes: bool  # the running decodes compute in it (one token each)
    prompts: bool  # prompt chunks: running prefills, then admissions
    token_budget: int  # tokens it may compute in all
    max_chunks: Optional[int] = None  # at most this many prompt chunks (None: the budget only)


class StepComposition(ABC):
    """The policy seam. `forwards()` is called once per fill (at most twice per step, see
    `Scheduler.schedule`); `built()` once per plan built. Invariant: every `Forward` it
    returns has a budget in [1, max_num_batched_tokens]."""

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget

    @abstractmethod
    def forwards(self) -> tuple[Forward, ...]:
        """The kinds of forward the next plan may be, in the order the filler tries them."""

    def built(self, num_decodes: int, num_chunks: int) -> None:
        """The plan just built computed `num_decodes` decodes and `num_chunks` prompt chunks."""
        del num_decodes, num_chunks  # stateless compositions; decode-first overrides it

    def check_invariants(self) -> None:
        """Raise AssertionError unless every forward offered fits the budget. Read-only."""
        for forward in self.forwards():
            assert 1 <= forward.token_budget <= self.token_budget, "composition: budget"
            assert forward.max_chunks is None or forward.max_chunks >= 1, "composition: chunks"


class Mixed(StepComposition):
    """Decodes and prompt chunks in one forward, under one budget."""

    def __init__(self, token_budget: int) -> None:
        super().__init__(token_budget)
        self._forwards = (Forward(True, True, token_budget),)

    def forwards(self) -> tuple[Forward, ...]:
        return self._forwards


class PrefillFirst(StepComposition):
    """A prefill-only forward whenever one schedules anything, else a decode-only one."""

    def __init__(self, token_budget: int) -> None:
        super().__init__(token_budget)
        self._forwards = (Forward(False, True, token_budget), Forward(True, False, token_budget))

    def forwards(self) -> tuple[Forward, ...]:
        return self._forwards


class DecodeFirst(StepComposition):
    """Iterations of a decode forward, then a prompt forward with the budget the decodes left
    (at most `max_chunks` chunks). With no decode to run the prompt forward takes the whole
    budget; with no prompt work the decode forwards follow each other."""

    def __init__(self, token_budget: int, max_chunks: int) -> None:
        super().__init__(token_budget)
        self._max_chunks = max_chunks
        self._decodes_first = (
            Forward(True, False, token_budget),
            Forward(False, True, token_budget, max_chunks),
        )
        # the budget the last decode forward left to its iteration's prompt forward; None
        # when the last plan was not a decode forward (the next iteration starts)
        self._left: Optional[int] = None

    def forwards(self) -> tuple[Forward, ...]:
        left = self._left
        if left is None:
            return self._decodes_first
        return (Forward(False, True, left, self._max_chunks), self._decodes_first[0])

    def built(self, num_decodes: int, num_chunks: int) -> None:
        # max_num_batched_tokens >= max_num_seqs >= decodes + running prefills, so a decode
        # forward leaves each running prefill one token at least (none left: every slot
        # decodes, and no prompt can run)
        left = self.token_budget - num_decodes
        self._left = left if num_decodes and not num_chunks and left > 0 else None


def composition_for(name: str, token_budget: int, max_prefill_chunks: int) -> StepComposition:
    """The policy object of `--step-composition` (a new one per scheduler core)."""
    if name == "mixed":
        return Mixed(token_budget)
    if name == "prefill-first":
        return PrefillFirst(token_budget)
    if name == "decode-first":
        return DecodeFirst(token_budget, max_prefill_chunks)
    raise ValueError(f"step_composition must be one of {', '.join(STEP_COMPOSITIONS)}")
