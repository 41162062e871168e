"""Reasoning output: a reasoning model's thinking part, apart from its answer.

`--reasoning-parser` (vLLM's flag and names) says how the model marks its thinking:

- `qwen3`: an output that opens with `<think>` thinks up to `</think>`, and the rest is
  the answer. An output that does not open with `<think>` is all answer: Qwen3 with
  `enable_thinking: false`, whose template closes an empty thinking part in the prompt.
- `deepseek_r1`: the output starts inside the thinking part (DeepSeek-R1's template opens
  `<think>` in the prompt; a `<think>` the output opens with itself is dropped) and
  thinks up to `</think>`; an output that never closes it is all thinking.

The tags belong to neither part. Two readers apply these rules, one to text, one to ids:

- `ReasoningSplitter` reads one choice's text as it is generated, in pieces that may split
  a tag anywhere, and says which text is thinking and which is answer: the chat API's
  `reasoning_content`, whole or streamed; content and tool calls are read from the answer.
- `ReasoningTracker` follows one sequence's output token ids for the guide stage, so that
  a structured output constraint starts on the token after `</think>` and leaves the
  thinking free, as vLLM's structured outputs do with a reasoning parser. It needs each
  tag to be one token of the tokenizer (`ReasoningParser.tokens`), as in Qwen3's and
  DeepSeek-R1's tokenizers; the readers agree when the model writes the tags as those
  tokens, which is how these models write them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowllm.messages import ReasoningTokens
from flowllm.text.tags import partial_suffix

REASONING_PARSERS = ("deepseek_r1", "qwen3")  # `--reasoning-parser` values
START_TAG = "<think>"
END_TAG = "</think>"

# Where a reader is in one output.
_START = 0  # nothing decided yet: the output may still open with `<think>`
_THINKING = 1
_ANSWER = 2


@dataclass(frozen=True)
class ReasoningParser:
    """One `--reasoning-parser`: its name, and whether its outputs start inside the
    thinking part."""

    name: str
    opens_inside: bool

    @classmethod
    def named(cls, name: str) -> ReasoningParser:
        if name not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {name!r}; expected one of {', '.join(REASONING_PARSERS)}"
            )
        return cls(name, opens_inside=name == "deepseek_r1")

    def splitter(self) -> ReasoningSplitter:
        """A reader of one choice's text."""
        return ReasoningSplitter(self.opens_inside)

    def tokens(self, tokenizer: Any) -> ReasoningTokens | None:
        """The tags as token ids, or None when the tokenizer does not hold each as one token
        (then constraints cannot start after the thinking part)."""
        start, end = _single_token(tokenizer, START_TAG), _single_token(tokenizer, END_TAG)
        if start is None or end is None:
            return None
        return ReasoningTokens(start=start, end=end, opens_inside=self.opens_inside)


def _single_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


class ReasoningSplitter:
    """One choice's output text, fed in pieces: the thinking and the answer in each piece.

    Text that may be the beginning of a tag is held until the next piece (or `finish`)
    says whether it is one, so a tag split across pieces never reaches either part.
    """

    __slots__ = ("_held", "_opens_inside", "_state")

    def __init__(self, opens_inside: bool) -> None:
        self._opens_inside = opens_inside
        self._state = _START
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) of the next piece of the output."""
        held = self._held + text
        self._held = ""
        if self._state == _START:
            if held.startswith(START_TAG):
                held = held[len(START_TAG) :]
                self._state = _THINKING
            elif START_TAG.startswith(held):  # too short to tell
                self._held = held
                return "", ""
            else:
                self._state = _THINKING if self._opens_inside else _ANSWER
        if self._state == _ANSWER:
            return "", held
        at = held.find(END_TAG)
        if at >= 0:
            self._state = _ANSWER
            return held[:at], held[at + len(END_TAG) :]
        keep = partial_suffix(held, END_TAG)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep], ""

    def finish(self) -> tuple[str, str]:
        """The output ended: (thinking, answer) of what was held back."""
        held, self._held = self._held, ""
        thinking = self._state == _THINKING or (self._state == _START and self._opens_inside)
        return (held, "") if thinking else ("", held)


class ReasoningTracker:
    """One sequence's output token ids, one at a time: which belong to the answer."""

    __slots__ = ("_state", "_tokens")

    def __init__(self, tokens: ReasoningTokens) -> None:
        self._tokens = tokens
        self._state = _THINKING if tokens.opens_inside else _START

    @property
    def answering(self) -> bool:
        """The next token is the answer's, unless it opens the thinking part (`may_open`)."""
        return self._state != _THINKING

    @property
    def start_token(self) -> int:
        return self._tokens.start

    @property
    def may_open(self) -> bool:
        """The next token is the output's first, and `<think>` there opens the thinking."""
        return self._state == _START

    def accept(self, token_id: int) -> bool:
        """Follow one output token; True when it is part of the answer."""
        if self._state == _ANSWER:
            return True
        if self._state == _START:
            if token_id == self._tokens.start:
                self._state = _THINKING
                return False
            self._state = _ANSWER
            return True
        if token_id == self._tokens.end:
            self._state = _ANSWER
        return False
