"""Logprobs in OpenAI's two shapes, from the engine's `TokenLogprobs`.

Token strings are the tokenizer's decoding of each single id (" the", not "Ġthe"), as
vLLM returns them; chat's `bytes` are the UTF-8 bytes of that string.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from flowllm.api.protocol import (
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogProbs,
    PromptLogprob,
)
from flowllm.messages import TokenLogprobs

# JSON has no -inf: a token the sampler ruled out reports this instead (as vLLM does).
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class TokenTexts:
    """Single-token strings, decoded once per id (bounded by the vocabulary size)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def decode(self, token_ids: Sequence[int]) -> str:
        """Several tokens as one text (multi-byte characters across tokens stay whole)."""
        return str(self._tokenizer.decode(list(token_ids)))

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def _top_dict(texts: TokenTexts, entry: TokenLogprobs, num_top: int) -> dict[str, float]:
    """The chosen token and the top-N alternatives, token string -> logprob."""
    top = {texts(entry.token_id): _finite(entry.logprob)}
    for token_id, logprob in entry.top[:num_top]:
        top.setdefault(texts(token_id), _finite(logprob))
    return top


def completion_logprobs(
    texts: TokenTexts,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprobs | None],
    num_top: int,
    text_offset: int,
) -> CompletionLogProbs:
    """Parallel lists for `token_ids`; a None entry (the first prompt token) has no logprob.

    `text_offset` is where the first token's text starts in the choice's returned text.
    """
    out = CompletionLogProbs()
    offset = text_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = texts(token_id)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(_finite(entry.logprob))
            out.top_logprobs.append(_top_dict(texts, entry, num_top))
    return out


def prompt_logprobs_entries(
    texts: TokenTexts, entries: Sequence[TokenLogprobs | None], num_top: int
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, token id -> logprob, rank, text."""
    out: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        item = {
            str(entry.token_id): PromptLogprob(
                logprob=_finite(entry.logprob), rank=entry.rank, decoded_token=texts(entry.token_id)
            )
        }
        for rank, (token_id, logprob) in enumerate(entry.top[:num_top], start=1):
            item.setdefault(
                str(token_id),
                PromptLogprob(logprob=_finite(logprob), rank=rank, decoded_token=texts(token_id)),
            )
        out.append(item)
    return out


def chat_logprobs(
    texts: TokenTexts, entries: Sequence[TokenLogprobs], num_top: int
) -> list[ChatTokenLogprob]:
    """Chat's `logprobs.content`: one item per generated token with its top-N."""
    out = []
    for entry in entries:
        token = texts(entry.token_id)
        top = []
        for token_id, logprob in entry.top[:num_top]:
            text = texts(token_id)
            top.append(
                ChatTopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))
            )
        out.append(
            ChatTokenLogprob(
                token=token,
                logprob=_finite(entry.logprob),
                bytes=list(token.encode()),
                top_logprobs=top,
            )
        )
    return out
