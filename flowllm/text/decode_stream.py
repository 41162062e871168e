"""Incremental text of a fast tokenizer through the `tokenizers` library's `DecodeStream`.

`DecodeStream` keeps a sequence's short decode window in Rust and returns the text each new
token completes, or None while the text ends inside a character (U+FFFD), which is the rule
the window decode in `flowllm.text.detokenizer` applies from Python. For a fast tokenizer
that is not byte-level BPE (SentencePiece-style BPE with byte fallback, WordPiece, ...) it
costs half of re-decoding the window in Python per token, and it holds back every byte of
an incomplete character, where byte fallback decodes each to its own U+FFFD and the
window held back only the last (benchmarks/README.md, "Pipeline overhead"). Byte-level
tokenizers keep their byte table (`ByteDecode`), cheaper still.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_CONTEXT_TOKENS = 4  # ids kept before the unread ones when a stream's tail is decoded
_KEEP_TOKENS = 64  # read ids beyond this many are dropped, down to the context


@functools.cache
def can_stream() -> bool:
    """Does the installed `tokenizers` have a DecodeStream that starts from given ids
    (0.22 on)? Without one, every tokenizer takes the other read paths."""
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(ids=[], skip_special_tokens=False)
    except (ImportError, TypeError):
        return False
    return True


class StreamDecode:
    """A decode function (ids -> text, the backend's) that also opens `TextStream`s.

    Build it once per tokenizer and `skip_special_tokens` flag (`make_decode` in
    flowllm.text.detokenizer does); ids the tokenizer lacks are skipped, as its decode does.
    """

    __slots__ = ("_known", "backend", "decode", "skip_special_tokens")

    def __init__(
        self, backend: Tokenizer, skip_special_tokens: bool, decode: Callable[[list[int]], str]
    ) -> None:
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self.decode = decode
        ids = backend.get_vocab(with_added_tokens=True).values()
        known = bytearray(max(ids, default=-1) + 1)
        for i in ids:
            known[i] = 1
        self._known = known

    def __call__(self, ids: list[int]) -> str:
        return self.decode(ids)

    def knows(self, token_id: int) -> bool:
        """Does the tokenizer have this id (else decoding skips it)?"""
        return 0 <= token_id < len(self._known) and self._known[token_id] == 1

    def open(self, context: list[int]) -> TextStream:
        """A stream whose text continues that of `context` (ids before the first output)."""
        return TextStream(self, context)


class TextStream:
    """One sequence's text: `push` each output id, `tail` once at the end.

    Byte fallback decodes a run of byte tokens as a whole: when an invalid byte joins a run,
    every byte of it becomes U+FFFD, also those of text already sent, and `DecodeStream`
    raises (its prefix no longer holds). The text sent stays; the stream starts again from
    the ids not yet read, so the text after them is exact again.
    """

    __slots__ = ("_backend", "_ids", "_knows", "_read", "_skip", "_step", "_tail_decode")

    def __init__(self, decode: StreamDecode, context: list[int]) -> None:
        self._backend = decode.backend
        self._skip = decode.skip_special_tokens
        self._knows = decode.knows
        self._tail_decode = decode.decode
        self._step = self._open(context)
        self._ids = list(context)  # the context, then the ids pushed (the last ones)
        self._read = len(self._ids)  # ids[:read] produced the text returned so far

    def _open(self, context: list[int]) -> Callable[[Any, int], str | None]:
        from tokenizers.decoders import DecodeStream

        stream: Any = DecodeStream(ids=context, skip_special_tokens=self._skip)
        return cast("Callable[[Any, int], str | None]", stream.step)

    def push(self, token_id: int) -> str:
        """The text `token_id` completes ("" while it ends inside a character)."""
        if not self._knows(token_id):
            return ""
        ids = self._ids
        ids.append(token_id)
        try:
            text = self._step(self._backend, token_id)
        except Exception:  # tokenizers raises a bare Exception for the broken prefix
            return self._restart()
        if text is None:
            return ""
        self._advance(len(ids))
        return text

    def tail(self) -> str:
        """The text of the ids that completed none yet, as the full decode has it."""
        ids, read = self._ids, self._read
        if read == len(ids):
            return ""
        decode = self._tail_decode
        before = ids[max(0, read - _CONTEXT_TOKENS) : read]
        text = decode(before + ids[read:])
        self._read = len(ids)
        return text[len(decode(before)) :]

    def _advance(self, read: int) -> None:
        """ids[:read] are read; only the last few of them are ever decoded again."""
        if read > _KEEP_TOKENS:
            del self._ids[: read - _CONTEXT_TOKENS]
            read = _CONTEXT_TOKENS
        self._read = read

    def _restart(self) -> str:
        """A new stream over the unread ids; their text. If it breaks too, their text is
        given up and the stream starts clean after them."""
        self._step = self._open([])
        ids, first = self._ids, self._read
        text = ""
        for i in range(first, len(ids)):
            try:
                piece = self._step(self._backend, ids[i])
            except Exception:
                self._step = self._open([])
                self._advance(len(ids))
                return text
            if piece is not None:
                text += piece
                self._advance(i + 1)
        return text
