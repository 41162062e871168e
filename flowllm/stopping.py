"""Token-level stop rules: when does a sampled token end its sequence?

Every stop rule is written here once. Rules 1-4 are applied by the sample stage to every
sampled token (`StopRule`), so that schedule and detokenize read the verdict off the
token (`SampledToken.finish_reason`) instead of deciding again; the scheduler's length
guard is `output_limit` below, the same limit rule 4 uses. Rule 5 needs text:
detokenize applies it as the text grows (`StopStrings`, from flowllm.text.detokenizer).

The rules, in order:

1. Before `min_tokens` outputs exist, only the length limits can end a sequence.
   (The sampler also masks EOS and stop_token_ids out of the logits while
   `num_output_tokens < min_tokens`, so in practice such tokens are not sampled then.)
2. EOS ends it with ("stop", None): the model chose to stop, so it wins over a length
   limit reached by the same token. `ignore_eos` lets it go on, unless the sequence has a
   structured-output constraint: the grammar decides where such an output ends, and once
   complete allows nothing but EOS.
3. A token in `stop_token_ids` ends it with ("stop", token_id).
4. `max_tokens` outputs, or a total length (prompt + outputs) of `max_model_len`, end it
   with ("length", None): there is no room or no budget for another token.
5. A stop string in the output text ends it with ("stop", the string): the text is cut
   where it begins; when several appear at once, the one that completes first wins.
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_left
from collections.abc import Iterable
from typing import NamedTuple

from flowllm.messages import FinishReason, SamplingParams


def output_limit(
    params: SamplingParams, num_prompt_tokens: int, max_model_len: int | None
) -> float:
    """The output count at which rule 4 ends a sequence: `max_tokens` (None: unbounded),
    or fewer when the context (`max_model_len`, None: no limit) fills first."""
    limit = math.inf if params.max_tokens is None else params.max_tokens
    if max_model_len is not None:
        limit = min(limit, max_model_len - num_prompt_tokens)
    return limit


class StopRule:
    """The stop rules for one sequence, its fixed arguments folded in once.

    The sampler calls it for every sampled token of every sequence, so the per-token work
    is two integer comparisons and one set lookup. A token outside `stopping_ids` whose
    sequence had fewer than `last_output` outputs before it ends nothing: a caller with
    many tokens may test that first and call the rule only when it fails.
    """

    __slots__ = ("eos", "last_output", "length_limit", "min_tokens", "stopping_ids")

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Iterable[int],
        num_prompt_tokens: int,
        max_model_len: int | None,
    ) -> None:
        ignored = params.ignore_eos and params.structured_outputs is None
        self.eos = frozenset(()) if ignored else frozenset(eos_token_ids)
        self.stopping_ids = self.eos | frozenset(params.stop_token_ids)  # EOS and stop ids
        self.min_tokens = params.min_tokens
        self.length_limit = output_limit(params, num_prompt_tokens, max_model_len)
        self.last_output = self.length_limit - 1  # outputs before the token that reaches it

    def __call__(
        self, token_id: int, num_output_tokens: int
    ) -> tuple[FinishReason | None, int | None]:
        """(finish_reason, stop_reason) for a token that makes `num_output_tokens` outputs;
        (None, None) to go on."""
        if num_output_tokens >= self.min_tokens and token_id in self.stopping_ids:
            return ("stop", None) if token_id in self.eos else ("stop", token_id)
        if num_output_tokens >= self.length_limit:
            return "length", None
        return None, None


class StopStrings:
    """Rule 5 for one sequence: its stop strings (empty ones dropped), matched on text.

    `first_match` finds a stop string in the text not yet emitted; `held_back` says how
    much of that text's end must wait, since the next text may complete a stop string
    there.
    """

    __slots__ = ("_prefixes", "strings")

    def __init__(self, stop: Iterable[str]) -> None:
        self.strings = tuple(s for s in stop if s)
        self._prefixes = _prefixes_by_last_char(self.strings)

    def __bool__(self) -> bool:
        return bool(self.strings)

    def first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first (then starts first), if any."""
        best: tuple[int, int, str] | None = None
        for s in self.strings:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop
        string."""
        return _partial_stop_suffix(text, self._prefixes)


class _Prefixes(NamedTuple):
    """The proper prefixes of the stop strings ending in one character, longest first, as
    (length, stop string) pairs; `neg_lengths` (ascending) lets a lookup skip at once the
    prefixes longer than the text."""

    neg_lengths: list[int]
    entries: list[tuple[int, str]]


@functools.lru_cache(maxsize=16)
def _prefixes_by_last_char(stops: tuple[str, ...]) -> dict[str, _Prefixes]:
    """Proper prefixes of the stop strings, grouped by their last character, longest first.

    Linear in the stop strings' total length (a prefix is its length, not a copy), and
    shared by every sequence with the same stop strings (the n choices of a request).
    """
    table: dict[str, set[tuple[int, str]]] = {}
    for s in stops:
        for k in range(1, len(s)):
            table.setdefault(s[k - 1], set()).add((k, s))
    grouped = {}
    for c, pairs in table.items():
        entries = sorted(pairs, reverse=True)
        grouped[c] = _Prefixes([-k for k, _ in entries], entries)
    return grouped


def _partial_stop_suffix(text: str, prefixes: dict[str, _Prefixes]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    if not text:
        return 0
    group = prefixes.get(text[-1])
    if group is None:
        return 0
    entries = group.entries
    for i in range(bisect_left(group.neg_lengths, -len(text)), len(entries)):
        k, stop = entries[i]
        if text.endswith(stop[:k]):
            return k
    return 0
