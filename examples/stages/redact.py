"""redact: mask listed words in generated text, between detokenize and deliver.

Insert it on the `detokenize.out -> deliver.in` edge (examples/graphs/redact.yaml):

    - {name: redact, use: ../stages/redact.py:Redact, with: {words: [secret, password]}}

A word is a maximal run of word characters (`\\w`, as Python's `re` defines it); a listed
word is masked only where it stands as a whole word ("secret" is masked, "secretary" is
not), ignoring case by default. Streaming sends a choice's text a token at a time, so a
word can arrive split across chunks ("sec" + "ret"): the trailing run of word characters of
a chunk is held back while it is still a prefix of some listed word, and sent with the next
chunk of its choice or at the choice's finish. A run that can no longer become a listed
word is sent at once, so text without listed words is delayed by nothing.

Every chunk goes out with its token ids, logprobs, counts and finish reason unchanged, so
usage is what it would be without this stage; only `text` changes (it is empty while a
whole chunk is held back). Errors and aborts do not travel on this edge: errors go to
`deliver.errors` directly and aborts to `schedule`, so they pass untouched. The echoed
prompt (`echo`) is the client's own text and is left as it is. Token-level data is not
masked: a client that asks for logprobs sees each token's text, listed or not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from flowllm.graph.stage import PerMessageStage, StageContext
from flowllm.messages import Chunk, TextDeltas

_WORD = re.compile(r"\w+")
_LEADING_WORD = re.compile(r"\w*")
_TRAILING_WORD = re.compile(r"\w+\Z")
# How many messages pass between sweeps for the state of requests that left early.
_SWEEP_EVERY = 256


class RedactParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`with:` of the redact stage."""

    words: tuple[str, ...]  # the words to mask; each made of word characters only
    mask: str = "*"  # one character: repeated to the word's length; longer: the replacement
    ignore_case: bool = True

    def __post_init__(self) -> None:
        if not self.words:
            raise ValueError("words must list at least one word")
        bad = [w for w in self.words if not _WORD.fullmatch(w)]
        if bad:
            raise ValueError(
                f"words must be letters, digits or '_' only (a word is a run of \\w); "
                f"got {bad[0]!r}"
            )
        if not self.mask:
            raise ValueError("mask must not be empty")


@dataclass
class StreamState:
    """Where one choice's text stream stands between two of its chunks.

    Invariant: `held` and `dead` are never both set. `held` is a trailing partial word not
    yet sent (a prefix of a listed word); `dead` means the text sent so far ends inside a
    word that cannot be a listed word, so word characters that continue it are sent as is.
    """

    held: str = ""
    dead: bool = False


class Redactor:
    """The masking rules, free of channels so tests drive them directly."""

    def __init__(self, params: RedactParams) -> None:
        flags = re.IGNORECASE if params.ignore_case else 0
        # Longest first, so an alternation never stops at a shorter listed word.
        words = sorted(set(params.words), key=len, reverse=True)
        self._pattern = re.compile(r"\b(?:" + "|".join(map(re.escape, words)) + r")\b", flags)
        # fullmatch of this pattern <=> non-empty prefix of some word, under the same case
        # rules as `_pattern`: for "abc", a(?:b(?:c)?)?
        self._prefix = re.compile("|".join(_prefix_pattern(w) for w in words), flags)
        self._max_len = max(len(w) for w in words)
        self._mask = params.mask

    def _replace(self, match: re.Match[str]) -> str:
        mask = self._mask
        return mask * len(match.group()) if len(mask) == 1 else mask

    def redact(self, text: str) -> str:
        """`text` with every listed whole word masked (text taken as complete)."""
        return self._pattern.sub(self._replace, text)

    def could_become_word(self, partial: str) -> bool:
        """True when more word characters after `partial` could make a listed word."""
        return len(partial) <= self._max_len and self._prefix.fullmatch(partial) is not None

    def feed(self, state: StreamState, text: str, final: bool) -> str:
        """The masked text to send now for the next piece of a stream; updates `state`."""
        pending = state.held + text
        state.held = ""
        sent = ""
        if state.dead:
            # Word characters continuing a word that cannot match go out as they are.
            leading = _LEADING_WORD.match(pending)  # always matches, maybe empty
            end = leading.end() if leading is not None else 0
            sent, pending = pending[:end], pending[end:]
            if not pending and not final:
                return sent  # the dead word may continue in the next piece
            state.dead = False
        if final:
            return sent + self.redact(pending)
        tail = _TRAILING_WORD.search(pending)
        if tail is None:
            return sent + self.redact(pending)
        if self.could_become_word(tail.group()):
            state.held = tail.group()
            return sent + self.redact(pending[: tail.start()])
        state.dead = True
        return sent + self.redact(pending)


def _prefix_pattern(word: str) -> str:
    pattern = ""
    for char in reversed(word[1:]):
        pattern = f"(?:{re.escape(char)}{pattern})?"
    return re.escape(word[0]) + pattern


class Redact(PerMessageStage):
    """Masks listed words in each choice's text, chunk by chunk (see the module docstring)."""

    inputs = {"in": TextDeltas}
    outputs = {"out": TextDeltas}
    Params = RedactParams

    def __init__(self, params: RedactParams, services: Any) -> None:
        super().__init__(params, services)
        self.redactor = Redactor(params)
        # (request_id, choice index) -> its stream state, from its first chunk to its last.
        self._streams: dict[tuple[str, int], StreamState] = {}
        self._mailboxes = getattr(services, "mailboxes", None)
        self._handled = 0

    async def handle(self, message: TextDeltas, ctx: StageContext) -> None:
        chunks = tuple(self.redact_chunk(chunk) for chunk in message.chunks)
        await ctx.emit("out", TextDeltas(step_id=message.step_id, chunks=chunks))
        self._handled += 1
        if self._handled % _SWEEP_EVERY == 0:
            self.forget_departed()

    def redact_chunk(self, chunk: Chunk) -> Chunk:
        """The chunk with its text masked; every other field unchanged."""
        key = (chunk.request_id, chunk.index)
        final = chunk.finish_reason is not None
        state = self._streams.pop(key, None) if final else self._streams.get(key)
        if state is None:
            state = StreamState()
            if not final:
                self._streams[key] = state
        text = self.redactor.feed(state, chunk.text, final)
        return chunk if text == chunk.text else msgspec.structs.replace(chunk, text=text)

    def forget_departed(self) -> None:
        """Drop the state of requests that left without a last chunk (aborted, failed):
        their mailbox is gone, and deliver drops any chunk still on its way."""
        if self._mailboxes is None:
            return
        gone = [key for key in self._streams if self._mailboxes.get(key[0]) is None]
        for key in gone:
            del self._streams[key]

    @property
    def open_streams(self) -> int:
        """Choices with state kept between chunks (for tests and debugging)."""
        return len(self._streams)
