"""llguidance against xgrammar on the real model's vocabulary (the choice of library, issue 29).

For each schema of bench/structured_schemas.py, each library, one thread:
* compile: schema -> what a matcher starts from (llguidance: the matcher itself, built lazily;
  xgrammar: the compiled grammar, its cache off), then the first mask (llguidance builds its
  lexer states on demand, so the first mask is part of its start);
* per-token mask: the schema's example, tokenized by the model's tokenizer and fed token by
  token, one bitmask fill before each token (the teacher-forced walk a reply makes);
* rollback: after the walk, roll back k tokens and consume them again (k = 1, 4, 16).

Prints one JSON line per library with p50 / p99 / max, and the ratio table. xgrammar is not a
dependency: install it apart (`pip install --target DIR --no-deps xgrammar apache-tvm-ffi`,
then PYTHONPATH=DIR:.; it imports transformers, which the tests install).

    PYTHONPATH=. .venv/bin/python bench/grammar_libs.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.structured_schemas import CASES
from shared.model_files import prepare_model

KS = (1, 4, 16)


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class LlgSide:
    name = "llguidance"

    def __init__(self, folder: Path, vocab_size: int) -> None:
        import llguidance
        import llguidance.torch as lt

        self.llg, self.lt = llguidance, lt
        text = (folder / "tokenizer.json").read_text()
        start = time.perf_counter()
        self.tok = llguidance.LLTokenizer(text, n_vocab=vocab_size)
        self.tokenizer_s = time.perf_counter() - start
        self.mask = lt.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        matcher = self.llg.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled

    def fill(self, m: Any) -> None:
        self.lt.fill_next_token_bitmask(m, self.mask, 0)

    def consume(self, m: Any, token: int) -> None:
        assert m.consume_token(token), m.get_error()

    def rollback(self, m: Any, k: int) -> None:
        assert m.rollback(k)


class XgrSide:
    name = "xgrammar"

    def __init__(self, folder: Path, vocab_size: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        start = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.tokenizer_s = time.perf_counter() - start
        self.mask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any) -> None:
        m.fill_next_token_bitmask(self.mask, 0)

    def consume(self, m: Any, token: int) -> None:
        assert m.accept_token(token)

    def rollback(self, m: Any, k: int) -> None:
        m.rollback(k)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure(side: Any, walks: list[tuple[dict[str, Any], list[int]]]) -> dict[str, Any]:
    compile_s, first_s, mask_s = [], [], []
    rollback_s: dict[int, list[float]] = {k: [] for k in KS}
    for schema, tokens in walks:
        compiled, c = timed(lambda s=schema: side.compile(s))
        m = side.matcher(compiled)
        _, f = timed(lambda m=m: side.fill(m))
        compile_s.append(c)
        first_s.append(c + f)
        side.consume(m, tokens[0])
        for tok in tokens[1:]:
            _, t = timed(lambda m=m: side.fill(m))
            mask_s.append(t)
            side.consume(m, tok)
        for k in KS:
            if k > len(tokens):
                continue
            start = time.perf_counter()
            side.rollback(m, k)
            for tok in tokens[len(tokens) - k :]:
                side.consume(m, tok)
            rollback_s[k].append(time.perf_counter() - start)

    def stats(xs: list[float]) -> dict[str, float]:
        return {"p50_ms": round(pct(xs, 0.5) * 1e3, 4), "p99_ms": round(pct(xs, 0.99) * 1e3, 4),
                "max_ms": round(max(xs) * 1e3, 4)}  # fmt: skip

    return {
        "library": side.name,
        "tokenizer_s": round(side.tokenizer_s, 3),
        "compile": stats(compile_s),
        "compile_and_first_mask": stats(first_s),
        "mask_per_token": stats(mask_s),
        "num_tokens": len(mask_s),
        **{f"rollback_{k}_and_replay": stats(v) for k, v in rollback_s.items() if v},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the median round is kept")
    parser.add_argument("--libraries", default="llguidance,xgrammar")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = prepare_model(None)
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    walks = [(c.schema, tok.encode(compact(c.example), add_special_tokens=False).ids)
             for c in CASES]  # fmt: skip
    sides = {"llguidance": LlgSide, "xgrammar": XgrSide}
    results = []
    for name in args.libraries.split(","):
        side = sides[name](folder, vocab_size)
        rounds = [measure(side, walks) for _ in range(args.repeat)]
        rounds.sort(key=lambda r: r["mask_per_token"]["p50_ms"])
        results.append(rounds[len(rounds) // 2])
        print(json.dumps(results[-1]))
    if len(results) == 2:
        a, b = results
        for key in ("compile_and_first_mask", "mask_per_token", "rollback_4_and_replay"):
            ratio = statistics.fmean([b[key]["p50_ms"] / max(a[key]["p50_ms"], 1e-9)])
            print(f"{key}: {b['library']} / {a['library']} p50 = {ratio:.2f}")


if __name__ == "__main__":
    main()
