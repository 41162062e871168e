"""Constrained decoding with xgrammar: compile a constraint once, then match token by token.

`Grammars` belongs to one tokenizer: it compiles a request's `StructuredOutputs` (a JSON
schema, any JSON object, a regex, a list of choices or an EBNF/GBNF grammar) and keeps the
compiled grammars in a bounded LRU cache keyed by the constraint, so the same schema
compiles once per tokenizer. A `Matcher` follows one sequence: it fills the packed bitmask
of the tokens allowed next and accepts each sampled token. When the grammar is complete,
only the stop tokens (the model's EOS) are allowed, so a sequence whose grammar accepts
and allows no continuation ends with finish_reason "stop".

xgrammar rather than llguidance: on the bundled SmolLM2 tokenizer it fills a small
schema's bitmask faster (benchmarks/README.md, "Grammar engines"), and that cost is paid
per constrained sequence per step, while a compile is paid once per schema.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flowllm.messages import StructuredOutputs

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

# Compiled grammars kept per tokenizer: a JSON schema's is tens of KB to a few MB.
CACHE_ENTRIES = 256
# xgrammar's errors start "[hh:mm:ss] /path/file.cc:line: "; the client needs the rest.
_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class GrammarError(ValueError):
    """The constraint cannot be compiled: `param` names the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def constraint_kind(spec: StructuredOutputs) -> list[str]:
    """The kinds of constraint `spec` sets (exactly one is valid)."""
    kinds = [
        name for name in ("json", "regex", "choice", "grammar") if getattr(spec, name) is not None
    ]
    if spec.json_object:
        kinds.append("json_object")
    return kinds


def json_schema_text(schema: dict[str, Any] | str) -> str:
    """A JSON schema as compact JSON text (the cache key and what xgrammar compiles); key
    order is kept: it is the order properties are generated in."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar accepting exactly one of `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _source(spec: StructuredOutputs) -> tuple[str, str]:
    """(kind, text): what to compile, which is also its cache key."""
    if spec.json is not None:
        return "json", json_schema_text(spec.json)
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        return "grammar", choice_grammar(spec.choice)
    if spec.grammar is not None:
        return "grammar", spec.grammar
    return "json_object", ""


class Matcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher: xgr.GrammarMatcher = _xgrammar().GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (state unchanged) when the grammar forbids it."""
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepts (drafts followed tentatively)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a packed int32 bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())


def _xgrammar() -> Any:
    """xgrammar, imported on first use: it imports transformers, which a server's start
    would otherwise wait for before loading the weights (the tokenizer loads beside them)."""
    import xgrammar

    return xgrammar


class Grammars:
    """Compiles constraints for one tokenizer and caches the results (thread safe)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_entries: int = CACHE_ENTRIES,
    ) -> None:
        self.vocab_size = vocab_size
        self._cache_entries = cache_entries
        self._info: xgr.TokenizerInfo = _xgrammar().TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self._compiler: xgr.GrammarCompiler = _xgrammar().GrammarCompiler(
            self._info, cache_enabled=False
        )
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when compiled before.

        Raises GrammarError naming `spec.param` when it does not compile."""
        try:
            key = _source(spec)
        except (ValueError, RecursionError) as exc:
            raise GrammarError(f"Invalid JSON schema in '{spec.param}': {exc}", spec.param) from exc
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile(*key, spec.param)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str, param: str) -> xgr.CompiledGrammar:
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(kind, kind)
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "grammar":
                return self._compiler.compile_grammar(text)
            return self._compiler.compile_builtin_json_grammar()
        except (RuntimeError, ValueError, TypeError) as exc:
            lines = str(exc).strip().splitlines()
            reason = _SOURCE_PREFIX.sub("", lines[-1]) if lines else type(exc).__name__
            raise GrammarError(f"Invalid {what} in '{param}': {reason}", param) from exc

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        return Matcher(self.compile(spec))

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """A packed bitmask for `rows` sequences: [rows, ceil(vocab_size / 32)] int32."""
        bitmask: torch.Tensor = _xgrammar().allocate_token_bitmask(rows, self.vocab_size)
        return bitmask


def allow_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set token `token_id`'s bit in row `row` of a packed bitmask (besides the grammar's)."""
    word, bit = divmod(token_id, 32)
    value = int(bitmask[row, word]) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # as int32
