"""Prompt lookup: draft tokens for speculative decoding from a sequence's own tokens.

A sequence that quotes its prompt, or repeats itself, continues the way its text went
before: the longest suffix n-gram (`max_n` tokens down to `min_n`) that occurred earlier
is looked up, and the tokens that followed its earliest occurrence are the drafts (as
vLLM's NgramProposer; they never run past the sequence's end). The model verifies them,
so a wrong draft costs compute, never a different output.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

_INITIAL = 256  # tokens a history holds before it first grows


class TokenLog:
    """A sequence's prompt and output tokens, in a growing array (appends are amortized
    O(1), and lookups read a view)."""

    __slots__ = ("_ids", "n")

    def __init__(self, token_ids: tuple[int, ...]) -> None:
        self._ids = np.zeros(max(_INITIAL, 2 * len(token_ids)), dtype=np.int64)
        self._ids[: len(token_ids)] = token_ids
        self.n = len(token_ids)

    def append(self, token_id: int) -> None:
        if self.n == len(self._ids):
            self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
        self._ids[self.n] = token_id
        self.n += 1

    @property
    def ids(self) -> np.ndarray[tuple[int], np.dtype[np.int64]]:
        return self._ids[: self.n]


def propose(
    tokens: np.ndarray[tuple[int], np.dtype[np.int64]], k: int, min_n: int, max_n: int
) -> tuple[int, ...]:
    """Up to `k` drafts after `tokens`: what followed the earliest earlier occurrence of
    its longest suffix n-gram with `min_n <= n <= max_n`; () when none occurred."""
    total = len(tokens)
    head = tokens[: total - 1]  # an occurrence must be followed by at least one token
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        hits = np.flatnonzero((sliding_window_view(head, n) == tokens[total - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tuple(tokens[start : start + k].tolist())
    return ()
