"""Natural-text workloads for speculative decoding (issue 30): prompts whose answer repeats
text of the prompt, made with the model's own tokenizer and chat template.

* `copy`: copy a given text or code verbatim;
* `edit`: the same text edited (code: a function renamed; prose: one sentence per line);
* `quote`: a question answered by quoting the text.

Four fixed texts (two Python snippets, two paragraphs), request `i` takes text `i % 4`, so a
workload is the same token for token on every machine with the same tokenizer. The answer's
first line is part of the prompt (the assistant's turn already begun), which keeps a small
model on the task; greedy outputs end at the model's own end of turn, within `max_tokens` (the
text's length and a margin).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

TEXT_WORKLOADS = ("copy", "edit", "quote")
MARGIN_TOKENS = 32  # max_tokens beyond the text's own length (copy, edit)
QUOTE_MAX_TOKENS = 96


@dataclass(frozen=True, slots=True)
class Text:
    kind: str  # "code" | "prose"
    body: str
    rename: tuple[str, str]  # edit of code: (old name, new name)
    question: str  # quote


TEXTS = (
    Text(
        "code",
        '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; returns them sorted by start."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """The length of the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))
''',
        ("merge_intervals", "join_ranges"),
        "What does total_covered return?",
    ),
    Text(
        "prose",
        "The lighthouse on the northern cape was built in 1871 from granite quarried on the "
        "island itself. Its lamp first burned whale oil, then kerosene, and was electrified in "
        "1932, when a cable was laid across the strait. The last keeper, Marta Lindqvist, left "
        "in 1987, after the light had been automated; she had lived in the tower for "
        "twenty-two years and kept a logbook of every ship that passed. The logbook is now in "
        "the town museum, beside the original lens, which weighs almost two tonnes and was "
        "made in Paris. Visitors can climb the 114 steps to the gallery from May to September, "
        "weather permitting.",
        ("", ""),
        "Who was the last keeper of the lighthouse, and when did she leave?",
    ),
    Text(
        "code",
        '''class RateLimiter:
    """Allow at most `rate` events per second, with bursts up to `burst`."""

    def __init__(self, rate, burst):
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.updated = 0.0

    def allow(self, now):
        elapsed = now - self.updated
        self.updated = now
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate)
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False
''',
        ("RateLimiter", "TokenBucket"),
        "What does allow return when no token is left?",
    ),
    Text(
        "prose",
        "Bread rises because yeast feeds on the sugars in flour and releases carbon dioxide. "
        "The gas is trapped by gluten, a network of proteins that forms when the dough is "
        "kneaded, and the dough swells like a sponge. A warm kitchen speeds the yeast up, while "
        "a cold one slows it down, which is why some bakers leave their dough in the "
        "refrigerator overnight to develop more flavour. In the oven the trapped gas expands, "
        "the yeast dies at about sixty degrees, and the crust browns as sugars and proteins "
        "react on the surface.",
        ("", ""),
        "Why do some bakers leave their dough in the refrigerator overnight?",
    ),
)


def task(workload: str, text: Text) -> tuple[str, str]:
    """(the user's message, the start of the answer) of `workload` on `text`."""
    fence = "```python\n" if text.kind == "code" else ""
    shown = f"```python\n{text.body}```" if text.kind == "code" else text.body
    if workload == "copy":
        what = "code" if text.kind == "code" else "text"
        return f"Copy this {what} exactly, without any change:\n\n{shown}", fence
    if workload == "edit":
        if text.kind == "code":
            old, new = text.rename
            return f"Rename {old} to {new} everywhere in this code:\n\n{shown}", fence
        return f"Rewrite this text with one sentence per line:\n\n{shown}", ""
    if workload == "quote":
        return f"{shown}\n\n{text.question} Answer by quoting the text above.", '"'
    raise ValueError(f"not a text workload: {workload!r}")


def tokenizer_folder(spec: Optional[str]) -> str:
    """The folder of the model `spec` names (`--tokenizer`, else `--model`; None: the packaged
    SmolLM2), converted from a GGUF once. ValueError when it is no model."""
    from shared.model_files import prepare_model

    return str(prepare_model(spec))


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer  # only text workloads need it

    return AutoTokenizer.from_pretrained(path)


def text_prompts(
    workload: str, tokenizer_path: str, num_prompts: int
) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) for each request of `workload`."""
    tok = _tokenizer(tokenizer_path)
    out = []
    for i in range(num_prompts):
        text = TEXTS[i % len(TEXTS)]
        user, answer_start = task(workload, text)
        if tok.chat_template:  # rendered, then tokenized as the engine's frontend does
            messages = [{"role": "user", "content": user}]
            prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            prompt = f"{user}\n\n"
        ids = tok(prompt + answer_start, add_special_tokens=False)["input_ids"]
        body_len = len(tok(text.body)["input_ids"])
        max_tokens = QUOTE_MAX_TOKENS if workload == "quote" else body_len + MARGIN_TOKENS
        out.append((ids, max_tokens))
    return out
