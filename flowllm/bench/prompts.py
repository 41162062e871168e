"""Random prompts like vLLM's random dataset: a chosen number of input tokens per prompt.

With a tokenizer, a prompt is random token ids decoded to text and re-encoded until the
text is about the requested number of tokens, so the server sees that many. Without one,
a prompt is random common English words, which most BPE vocabularies encode as one token
each (with the leading space), so the length is close but only an estimate.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec
import numpy as np

# Attempts at making decode(ids) re-encode to the target length; random byte-level tokens
# can merge or split across the decode/encode round trip.
_MAX_ROUND_TRIPS = 10

# Short, frequent words: each is one GPT-2 token with its leading space (a test checks it).
_WORD_TEXT = """
    the of and to in is was for on as with by he at from his an were are which this be or
    has had not but they it first one their its new after who also two been her she time
    all would there when can more during other into we may years out up over most some him
    only later about made then such them no these world between used three many year before
    so under both known well city while through where since part state school film team
    being any each war people what if end name long game group work found won days life
    play left line high same age great much number area back show four like home early must
    five set did way old said very place good still day our book small even best own local
    king power music run main last next will take make help here does song road sea head
    land air army party side open hand light point form water month page
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


class PromptError(ValueError):
    """A prompt cannot be built as asked (a length below one, an empty vocabulary)."""


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """One benchmark prompt: its text, its token count and how many tokens to ask for."""

    text: str
    prompt_len: int  # tokens by the tokenizer; the word count without one
    output_len: int  # sent as max_tokens


class TokenizerLike(Protocol):
    """The part of a transformers tokenizer the prompt builder uses."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def all_special_ids(self) -> list[int]: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


def random_lengths(
    rng: np.random.Generator, mean: int, range_ratio: float, count: int
) -> list[int]:
    """`count` lengths drawn uniformly from [mean * (1 - ratio), mean * (1 + ratio)], >= 1."""
    if mean < 1:
        raise PromptError(f"lengths must be >= 1, got {mean}")
    if not 0.0 <= range_ratio < 1.0:
        raise PromptError(f"range ratio must lie in [0, 1), got {range_ratio}")
    low = max(1, int(mean * (1.0 - range_ratio)))
    high = max(low, int(mean * (1.0 + range_ratio)))
    return [int(n) for n in rng.integers(low, high + 1, size=count)]


def word_prompt(rng: np.random.Generator, length: int) -> str:
    """`length` random words from `WORDS`, space-separated."""
    picks = rng.integers(0, len(WORDS), size=length)
    return " ".join(WORDS[i] for i in picks)


def token_prompt(
    tokenizer: TokenizerLike, rng: np.random.Generator, length: int, allowed: np.ndarray
) -> tuple[str, int]:
    """Text that the tokenizer encodes to about `length` tokens, and its exact token count.

    `allowed` holds the ids to draw from (the vocabulary minus special tokens).
    """
    ids = [int(i) for i in rng.choice(allowed, size=length)]
    text = tokenizer.decode(ids)
    encoded = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(_MAX_ROUND_TRIPS):
        if len(encoded) == length:
            break
        if len(encoded) > length:
            ids = list(encoded[:length])
        else:
            ids = list(encoded) + [int(i) for i in rng.choice(allowed, size=length - len(encoded))]
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text, add_special_tokens=False)
    return text, len(encoded)


def allowed_token_ids(tokenizer: TokenizerLike) -> np.ndarray:
    """The ids a random prompt may use: the base vocabulary without special tokens."""
    allowed = np.setdiff1d(
        np.arange(int(tokenizer.vocab_size), dtype=np.int64),
        np.asarray(tokenizer.all_special_ids, dtype=np.int64),
    )
    if allowed.size == 0:
        raise PromptError("the tokenizer has no ordinary tokens to build prompts from")
    return allowed


def random_prompts(
    num_prompts: int,
    input_len: int,
    output_len: int,
    *,
    seed: int,
    range_ratio: float = 0.0,
    tokenizer: TokenizerLike | None = None,
) -> list[Prompt]:
    """`num_prompts` random prompts; the same seed (and tokenizer) gives the same prompts."""
    if num_prompts < 1:
        raise PromptError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    input_lens = random_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = random_lengths(rng, output_len, range_ratio, num_prompts)
    allowed = allowed_token_ids(tokenizer) if tokenizer is not None else None
    prompts = []
    for n_in, n_out in zip(input_lens, output_lens, strict=True):
        if tokenizer is not None and allowed is not None:
            text, n_tokens = token_prompt(tokenizer, rng, n_in, allowed)
        else:
            text, n_tokens = word_prompt(rng, n_in), n_in
        prompts.append(Prompt(text=text, prompt_len=n_tokens, output_len=n_out))
    return prompts


def load_tokenizer(path: str) -> TokenizerLike:
    """A transformers tokenizer from a local directory (never the network)."""
    from transformers import AutoTokenizer

    # transformers types decode's result `str | list[str]` whatever the input; one
    # sequence of ids decodes to one str.
    tokenizer: TokenizerLike = AutoTokenizer.from_pretrained(  # type: ignore[assignment]
        path, local_files_only=True
    )
    return tokenizer
