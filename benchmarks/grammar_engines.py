"""xgrammar vs llguidance on the bundled SmolLM2 tokenizer: the figures behind the choice.

For each engine: building its tokenizer tables (once per server), compiling a small
nested JSON schema (once per schema; flowllm caches the result), and filling the token
bitmask at each step of a valid 42-token output (per constrained sequence per step, the
cost that matters under load). The engines alternate for `--rounds` rounds; medians.

    pip install llguidance   # or: pip install -e '.[bench]'
    .venv/bin/python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import xgrammar as xgr
from transformers import AutoTokenizer

from flowllm.models.bundled import ensure_bundled_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
OUTPUT = (
    '{"name": "Bob", "age": 42, "tags": ["a", "b"], "address": {"city": "Paris", "zip": "75001"}}'
)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def xgrammar_run(tokenizer: Any, vocab: int, ids: list[int]) -> dict[str, float]:
    t_info, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t_compile, compiled = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    fills = []
    for token in ids:
        t, _ = timed(lambda: matcher.fill_next_token_bitmask(bitmask, 0))
        fills.append(t)
        assert matcher.accept_token(token)
    return {"tables_ms": t_info * 1e3, "compile_ms": t_compile * 1e3,
            "fill_us": statistics.median(fills) * 1e6}  # fmt: skip


def llguidance_run(tokenizer: Any, vocab: int, ids: list[int]) -> dict[str, float]:
    t_info, tables = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    t_compile, matcher = timed(lambda: llguidance.LLMatcher(tables, grammar))
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    fills = []
    for token in ids:
        t, _ = timed(lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0))
        fills.append(t)
        assert matcher.consume_token(token)
    return {"tables_ms": t_info * 1e3, "compile_ms": t_compile * 1e3,
            "fill_us": statistics.median(fills) * 1e6}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_bundled_model()))
    vocab = len(tokenizer)
    ids = tokenizer.encode(OUTPUT)
    runs: dict[str, list[dict[str, float]]] = {"xgrammar": [], "llguidance": []}
    for _ in range(args.rounds):
        runs["xgrammar"].append(xgrammar_run(tokenizer, vocab, ids))
        runs["llguidance"].append(llguidance_run(tokenizer, vocab, ids))
    report = {
        name: {key: round(statistics.median(r[key] for r in rs), 2) for key in rs[0]}
        for name, rs in runs.items()
    }
    report["steps"] = len(ids)  # type: ignore[assignment]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
