"""Incremental detokenization: sampled token ids in, text deltas out, one sequence at a time.

The `detokenize` stage keeps one `IncrementalDetokenizer` per sequence and calls `step` with
each step's new tokens, then `finish` when the sequence ends for a reason other than a stop
string. Three promises:

- UTF-8 safe: a character whose bytes span several tokens is emitted once, whole. Text is
  decoded over a short window of recent tokens; a trailing U+FFFD (an incomplete character)
  is held back until the next token completes it, or until `finish`, which emits whatever
  the full decode has there.
- Streamed == full: the deltas of `step` and `finish` concatenate to the decode of all
  output ids (with `skip_special_tokens`), cut at a stop string if one matched. The window
  starts inside the prompt's last tokens, as vLLM does, so decoders that drop a leading
  space at the start of a text (SentencePiece) still give the spaced continuation; for
  byte-level BPE (GPT-2, Llama 3, SmolLM2) that equals the decode of the output ids alone.
- Stop strings (the rule: `flowllm.stopping.StopStrings`): when one appears, the
  text is cut there (kept with `include_stop_str_in_output`) and
  `DetokenizerStep.stop_string` names it. Only the text that could still begin a stop
  string is held back.

How text is read, by tokenizer:

- byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen): a table of each id's bytes, below;
- other fast tokenizers: the `tokenizers` library's `DecodeStream`
  (flowllm.text.decode_stream), which keeps the window in Rust;
- slow tokenizers, and `spaces_between_special_tokens=False` where added tokens exist: a
  window of recent tokens decoded from Python.

Decoding uses the fast tokenizer's backend directly (what `PreTrainedTokenizerFast.decode`
calls), skipping transformers' per-call overhead. For byte-level BPE tokenizers a window of
ordinary vocabulary ids is decoded in Python from a table of each id's bytes (`ByteVocab`),
which gives the backend's text (its ByteLevel decoder maps each token's characters back to
bytes and decodes them as UTF-8 with U+FFFD for invalid sequences) faster than a call
into the backend (benchmarks/README.md, "Pipeline overhead"); a window holding an added
token goes to the backend. A detokenizer keeps its window's bytes as tokens arrive
(`ByteDecode`), so a step decodes them directly.
`spaces_between_special_tokens=False` decodes the runs between added tokens separately and
joins them without the separator some decoders put around added tokens (skipped special
tokens are dropped first and separate nothing, as vLLM does it); byte-level
decoders put none, so for them both settings give the same text, as `tokenizer.decode`
does. Clean-up of tokenization spaces is not applied (transformers skips it for BPE models;
it cannot be done incrementally).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple, cast

from flowllm.messages import SamplingParams
from flowllm.stopping import StopStrings
from flowllm.text.decode_stream import StreamDecode, TextStream, can_stream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
_CONTEXT_TOKENS = 4  # tokens kept before the unread ones; a UTF-8 character spans <= 4 bytes
_MAX_WINDOW = 10  # window length that triggers a slide (decode cost grows with it)
_CONTEXT_LENGTHS = (4, 16, 64)  # prompt tokens tried as the first window's context

Decode = Callable[[list[int]], str]


class DetokenizerStep(NamedTuple):
    """New text since the previous step; `stop_string` is set when one ended the sequence."""

    text_delta: str
    stop_string: str | None = None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character that stands for it.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes take the characters
    from U+0100 on, in byte order.
    """
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    chars = [chr(b) for b in bs]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            chars.append(chr(256 + n))
            n += 1
    return dict(zip(bs, chars, strict=True))


class ByteVocab:
    """Each vocabulary id's bytes, for a tokenizer whose decoder is byte-level BPE alone.

    `table[i]` is id i's bytes (None for an id the model vocabulary lacks); `added` holds
    the added tokens' ids (special or not), which only the backend decodes; `texts[i]` is
    id i's text when its bytes are whole UTF-8 characters by themselves (None otherwise, and
    for added ids). Build it once per tokenizer (`of`), then pass it to `make_decode`.
    """

    __slots__ = ("added", "table", "texts")

    def __init__(self, table: list[bytes | None], added: frozenset[int]) -> None:
        self.table = table
        self.added = added
        self.texts = [None if i in added else _whole_text(b) for i, b in enumerate(table)]

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> ByteVocab | None:
        """The byte table of `tokenizer`, or None unless its decoder is ByteLevel alone."""
        from tokenizers import decoders

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
            return None
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=False)
        table: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for token, i in vocab.items():
            try:
                table[i] = bytes([byte_of[c] for c in token])
            except KeyError:  # not byte-level characters: the decoder keeps them as they are
                table[i] = token.encode()
        added = frozenset(backend.get_added_tokens_decoder())
        return cls(table, added)


def _whole_text(token: bytes | None) -> str | None:
    """The token's text if its bytes are complete UTF-8 characters, else None."""
    if token is None:
        return None
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        return None


_NO_TEXT = DetokenizerStep("")


def make_decode(
    tokenizer: PreTrainedTokenizerBase,
    skip_special_tokens: bool,
    spaces_between: bool,
    byte_vocab: ByteVocab | None = None,
) -> Decode:
    """A function ids -> text that matches `tokenizer.decode(ids, skip_special_tokens=...)`.

    For a fast tokenizer, its backend's decode; for any other tokenizer, its own decode with
    both flags. With `byte_vocab` (`ByteVocab.of(tokenizer)`), windows of ordinary ids are
    decoded from its table instead; without it, a fast tokenizer's decode also streams
    (`StreamDecode`) unless added tokens must be decoded apart (`spaces_between` False).
    Build it once per flag pair and pass it to every `IncrementalDetokenizer` (`decode=`) to
    skip the per-sequence lookups.
    """
    decode = _backend_decode(tokenizer, skip_special_tokens, spaces_between)
    if byte_vocab is not None:
        return ByteDecode(byte_vocab, decode)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    apart = not spaces_between and bool(getattr(tokenizer, "added_tokens_decoder", None))
    if backend is None or apart or not can_stream():
        return decode
    return StreamDecode(backend, skip_special_tokens, decode)


class ByteDecode:
    """The decode of a byte-level tokenizer: ids -> text from a `ByteVocab`'s table.

    Windows holding an added token (or an id the table lacks) go to `fallback`, the
    backend's decode. ids are >= 0 (validate rejects negative prompt ids; the sampler
    emits none). `window_bytes` and `token_bytes` let an `IncrementalDetokenizer` keep its
    window's bytes as it grows instead of joining them again for every token.
    """

    __slots__ = ("_added", "_lookup", "fallback", "texts")

    def __init__(self, vocab: ByteVocab, fallback: Decode) -> None:
        self._added = vocab.added
        self._lookup: Callable[[int], bytes | None] = vocab.table.__getitem__
        self.fallback = fallback
        self.texts = vocab.texts

    def __call__(self, ids: list[int]) -> str:
        window = self.window_bytes(ids)
        if window is None:
            return self.fallback(ids)
        return window.decode("utf-8", "replace")

    def window_bytes(self, ids: list[int]) -> bytes | None:
        """The ids' bytes joined, or None when the backend must decode them."""
        if not self._added.isdisjoint(ids):
            return None
        try:
            # An id the table lacks (None) makes join raise the TypeError caught below.
            return b"".join(cast("Iterable[bytes]", map(self._lookup, ids)))
        except (IndexError, TypeError):  # an id past the table, or one it lacks
            return None

    def token_bytes(self, token_id: int) -> bytes | None:
        """One id's bytes, or None when the backend must decode windows holding it."""
        if token_id in self._added:
            return None
        try:
            token: bytes | None = self._lookup(token_id)
        except IndexError:
            return None
        return token


def _backend_decode(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool, spaces_between: bool
) -> Decode:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:

        def slow_decode(ids: list[int]) -> str:
            return str(
                tokenizer.decode(
                    ids,
                    skip_special_tokens=skip_special_tokens,
                    spaces_between_special_tokens=spaces_between,
                )
            )

        return slow_decode

    def fast_decode(ids: list[int]) -> str:
        return str(backend.decode(ids, skip_special_tokens=skip_special_tokens))

    if spaces_between:
        return fast_decode
    added_decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    added = frozenset(added_decoder)
    if not added:
        return fast_decode
    # Skipped special tokens vanish before the runs are cut, as in vLLM: they separate
    # nothing (a character whose bytes straddle one still decodes whole).
    skipped = frozenset(
        i for i, token in added_decoder.items() if skip_special_tokens and token.special
    )

    def segmented_decode(ids: list[int]) -> str:
        if added.isdisjoint(ids):
            return fast_decode(ids)
        pieces: list[str] = []
        run: list[int] = []
        for t in ids:
            if t in skipped:
                continue
            if t in added:
                if run:
                    pieces.append(fast_decode(run))
                    run = []
                pieces.append(fast_decode([t]))
            else:
                run.append(t)
        if run:
            pieces.append(fast_decode(run))
        return "".join(pieces)

    return segmented_decode


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas (see the module docstring).

    Invariant: `_decode(_ids[_start:])`, less a trailing U+FFFD while not finished, is
    `_decoded` followed by text not yet read; everything read has been passed to the stop
    string check, which emitted it or holds it in `_held`.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        decode: Decode | None = None,
    ) -> None:
        self._decode = decode or make_decode(
            tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        self._stops = StopStrings(params.stop)
        self._include_stop = params.include_stop_str_in_output
        context, context_text = self._context(prompt_token_ids)
        self._ids: list[int] = context  # context tokens, then output tokens (the window's)
        self._start = 0  # the decode window is _ids[_start:]
        # With a byte-level decode: the window's bytes, kept as it grows (None while the
        # window holds an id only the backend decodes), so a step decodes them directly.
        self._bytes = self._decode if isinstance(self._decode, ByteDecode) else None
        self._wbytes = None if self._bytes is None else self._bytes.window_bytes(context)
        # A fast tokenizer's stream, when the decode streams (None: the window decode).
        self._stream: TextStream | None = (
            self._decode.open(context) if isinstance(self._decode, StreamDecode) else None
        )
        # Byte-level without stop strings: while the window is settled (every byte of it
        # read, ending on a character boundary), a token whose bytes are whole characters
        # adds exactly its own text (`append`).
        self._texts = self._bytes.texts if self._bytes is not None and not self._stops else None
        self._settled = False
        self._decoded = context_text  # text of the window already read
        self._held = ""  # read text held back because a stop string may begin there
        self._pieces: list[str] = []  # emitted deltas
        self.num_output_tokens = 0  # tokens fed so far (read only outside)
        self._stop_string: str | None = None
        self._done = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the sequence, if one did."""
        return self._stop_string

    @property
    def finished(self) -> bool:
        """A stop string matched or `finish` was called; later calls return no text."""
        return self._done

    def step(
        self, new_token_ids: Sequence[int], *, stop_terminated: bool = False
    ) -> DetokenizerStep:
        """Feed the step's new output tokens; return the text they complete.

        `stop_terminated`: the last id ended the sequence (EOS or one of stop_token_ids); as in
        vLLM its text is left out unless include_stop_str_in_output. Call `finish` after it.
        """
        if self._done:
            return DetokenizerStep("")
        ids = list(new_token_ids)
        self.num_output_tokens += len(ids)
        if stop_terminated and ids and not self._include_stop:
            ids.pop()
        if not ids:
            return DetokenizerStep("")
        if self._stream is not None:
            push = self._stream.push
            return self._emit("".join([push(token_id) for token_id in ids]), final=False)
        self._ids.extend(ids)
        for token_id in ids:
            self._push_bytes(token_id)
        return self._emit(self._read(final=False), final=False)

    def step_token(self, token_id: int, *, stop_terminated: bool = False) -> DetokenizerStep:
        """`step([token_id])`: the one-token-per-step case, without the list handling."""
        if self._done:
            return _NO_TEXT
        self.num_output_tokens += 1
        if stop_terminated and not self._include_stop:
            return _NO_TEXT
        if self._stream is not None:
            return self._emit(self._stream.push(token_id), final=False)
        self._ids.append(token_id)
        self._push_bytes(token_id)
        return self._emit(self._read(final=False), final=False)

    def append(self, token_id: int) -> str | None:
        """`step_token(token_id).text_delta` when that is just the token's own text (a
        byte-level tokenizer, no stop strings, whole characters after whole characters);
        None, changing nothing, otherwise: call `step_token` then."""
        texts = self._texts
        if texts is None or not self._settled or self._done or token_id >= len(texts):
            return None
        text = texts[token_id]
        if text is not None:
            self.num_output_tokens += 1
            self._pieces.append(text)
        return text

    def finish(self) -> DetokenizerStep:
        """The sequence ended (length, EOS, stop token, abort): emit everything held back."""
        if self._done:
            return DetokenizerStep("")
        text = self._read(final=True) if self._stream is None else self._stream.tail()
        result = self._emit(text, final=True)
        self._done = True
        return result

    # ------------------------------------------------------------------ internals

    def _context(self, prompt_token_ids: Sequence[int]) -> tuple[list[int], str]:
        """The prompt's last tokens that the window starts with, and their text: the fewest
        of 4, 16 or 64 whose text does not end inside a character (byte fallback decodes a
        run of byte tokens cut at its start to U+FFFD alone); none when the prompt itself
        ends inside one: the output is decoded on its own then."""
        for n in _CONTEXT_LENGTHS:
            context = list(prompt_token_ids[-n:])
            text = self._decode(context) if context else ""
            if not text.endswith(REPLACEMENT_CHAR):
                return context, text
            if len(context) < n:
                break
        return [], ""

    def _push_bytes(self, token_id: int) -> None:
        """Keep `_wbytes` the bytes of the window once `token_id` joined it."""
        window = self._wbytes
        if window is not None and self._bytes is not None:
            token = self._bytes.token_bytes(token_id)
            self._wbytes = None if token is None else window + token

    def _window_text(self) -> str:
        """`_decode(_ids[_start:])`, from the kept bytes when there are any."""
        window = self._wbytes
        if window is not None:
            return window.decode("utf-8", "replace")
        return self._decode(self._ids[self._start :])

    def _read(self, *, final: bool) -> str:
        """Decode the window and return its text not read before."""
        text = full = self._window_text()
        if not final and text.endswith(REPLACEMENT_CHAR):
            text = text[:-1]  # maybe an incomplete character: wait for more bytes
        new = ""
        if len(text) > len(self._decoded):
            new = text[len(self._decoded) :]
            self._decoded = text
        if self._wbytes is not None and text is full and len(text) == len(self._decoded):
            # Byte-level and read to a character boundary: the text that follows does not
            # depend on this window's bytes, so it restarts empty.
            self._ids.clear()
            self._start = 0
            self._wbytes = b""
            self._decoded = ""
            self._settled = True
            return new
        self._settled = False
        if len(self._ids) - self._start > _MAX_WINDOW:
            # Slide, keeping a few tokens of context: the bytes of an incomplete trailing
            # character lie in the last 3 tokens, so they stay inside the window.
            self._start = len(self._ids) - _CONTEXT_TOKENS
            if self._bytes is not None:
                self._wbytes = self._bytes.window_bytes(self._ids[self._start :])
            window = self._window_text()
            if not final and window.endswith(REPLACEMENT_CHAR):
                window = window[:-1]
            self._decoded = window
        return new

    def _emit(self, new_text: str, *, final: bool) -> DetokenizerStep:
        if not self._stops:
            if new_text:
                self._pieces.append(new_text)
            return DetokenizerStep(new_text)
        pending = self._held + new_text
        match = self._stops.first_match(pending)
        if match is not None:
            begin, stop = match
            delta = pending[: begin + len(stop) if self._include_stop else begin]
            self._held = ""
            self._stop_string = stop
            self._done = True
            if delta:
                self._pieces.append(delta)
            return DetokenizerStep(delta, stop)
        keep = 0 if final else self._stops.held_back(pending)
        delta = pending[: len(pending) - keep]
        self._held = pending[len(pending) - keep :]
        if delta:
            self._pieces.append(delta)
        return DetokenizerStep(delta)
