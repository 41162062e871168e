"""The reasoning parsers (flowllm.text.reasoning): text split into thinking and answer,
fed whole, in every split into pieces, and as a detokenized token stream; and the token
tracker the guide stage follows."""

from __future__ import annotations

import copy
from itertools import combinations, pairwise
from typing import Any

import pytest

from flowllm.messages import ReasoningTokens, SamplingParams
from flowllm.text.detokenizer import IncrementalDetokenizer
from flowllm.text.reasoning import (
    END_TAG,
    START_TAG,
    ReasoningParser,
    ReasoningSplitter,
    ReasoningTracker,
)

# (parser, output, expected thinking, expected answer), each split checked by hand.
CASES = [
    ("qwen3", "<think>Two and two.</think>It is 4.", "Two and two.", "It is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),  # thinking off: all answer
    ("qwen3", "<think></think>\n\nIt is 4.", "", "\n\nIt is 4."),  # an empty thinking part
    ("qwen3", "<think>Still going", "Still going", ""),  # cut off while thinking
    ("qwen3", "<thi", "", "<thi"),  # ended before it could be the tag: answer
    ("qwen3", "So <think>x</think>y", "", "So <think>x</think>y"),  # not opening: answer
    ("qwen3", "<think>a</think>b</think>c", "a", "b</think>c"),  # only the first closes
    ("qwen3", "<think>a</thinking>b", "a</thinking>b", ""),  # not the tag
    ("deepseek_r1", "Two and two.</think>It is 4.", "Two and two.", "It is 4."),
    ("deepseek_r1", "<think>Two and two.</think>It is 4.", "Two and two.", "It is 4."),
    ("deepseek_r1", "</think>It is 4.", "", "It is 4."),
    ("deepseek_r1", "Still going", "Still going", ""),  # never closed: all thinking
    ("deepseek_r1", "Almost</thi", "Almost</thi", ""),
    ("deepseek_r1", "<thi", "<thi", ""),
]


def split(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[list[str], list[str]]:
    thinking, answer = [], []
    for piece in pieces:
        t, a = splitter.feed(piece)
        thinking.append(t)
        answer.append(a)
    t, a = splitter.finish()
    return [*thinking, t], [*answer, a]


def every_split(text: str, cuts: int) -> list[list[str]]:
    """`text` cut at every choice of `cuts` positions (empty pieces included)."""
    out = []
    for points in combinations(range(len(text) + 1), cuts):
        bounds = [0, *points, len(text)]
        out.append([text[a:b] for a, b in pairwise(bounds)])
    return out


@pytest.mark.parametrize(("name", "output", "thinking", "answer"), CASES)
def test_the_split_whatever_the_pieces(name: str, output: str, thinking: str, answer: str) -> None:
    parser = ReasoningParser.named(name)
    splits = [[output], list(output), *every_split(output, 1), *every_split(output, 2)]
    for pieces in splits:
        got_thinking, got_answer = split(parser.splitter(), pieces)
        assert ("".join(got_thinking), "".join(got_answer)) == (thinking, answer), pieces


def test_nothing_is_held_longer_than_a_tag_could_need() -> None:
    """Text that cannot begin a tag goes out with its piece; a possible tag waits."""
    splitter = ReasoningParser.named("qwen3").splitter()
    assert splitter.feed("<th") == ("", "")  # may open the thinking part
    assert splitter.feed("ink>I") == ("I", "")
    assert splitter.feed(" see </") == (" see ", "")  # "</" may begin </think>
    assert splitter.feed("b") == ("</b", "")
    assert splitter.feed("</think") == ("", "")
    assert splitter.feed(">Yes") == ("", "Yes")
    assert splitter.feed("</think>") == ("", "</think>")  # the answer is not read for tags
    assert splitter.finish() == ("", "")


def test_a_detokenized_token_stream(gpt2_tokenizer: Any) -> None:
    """Sampled tokens through the incremental detokenizer, as the server streams them: the
    GPT-2 tokenizer writes each tag as several tokens, so every tag is split across
    deltas."""
    assert len(gpt2_tokenizer.encode(START_TAG)) == 3  # "<", "think", ">"
    assert len(gpt2_tokenizer.encode(END_TAG)) == 3  # "</", "think", ">"
    output = "<think>Let me count: 2+2.</think>\n\nIt is 4."
    prompt = tuple(gpt2_tokenizer.encode("Q: 2+2?"))
    detokenizer = IncrementalDetokenizer(gpt2_tokenizer, prompt, SamplingParams())
    deltas = [detokenizer.step_token(t).text_delta for t in gpt2_tokenizer.encode(output)]
    deltas.append(detokenizer.finish().text_delta)
    assert "".join(deltas) == output
    assert any(d.startswith("<") and "think" not in d for d in deltas)  # a tag arrives split
    thinking, answer = split(ReasoningParser.named("qwen3").splitter(), deltas)
    assert "".join(thinking) == "Let me count: 2+2."
    assert "".join(answer) == "\n\nIt is 4."
    for piece in thinking + answer:
        assert "<" not in piece and ">" not in piece


def test_tags_as_single_tokens(gpt2_tokenizer: Any) -> None:
    parser = ReasoningParser.named("deepseek_r1")
    assert parser.tokens(gpt2_tokenizer) is None  # several tokens each
    tokenizer = copy.deepcopy(gpt2_tokenizer)
    tokenizer.add_tokens([START_TAG, END_TAG])
    start, end = tokenizer.convert_tokens_to_ids([START_TAG, END_TAG])
    assert parser.tokens(tokenizer) == ReasoningTokens(start=start, end=end, opens_inside=True)
    assert ReasoningParser.named("qwen3").tokens(tokenizer) == ReasoningTokens(
        start=start, end=end, opens_inside=False
    )
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningParser.named("granite")


S, E = 900, 901  # the tags' ids in the tracker tests


@pytest.mark.parametrize(
    ("opens_inside", "tokens", "answer"),
    [
        (False, [S, 1, 2, E, 3, 4], [0, 0, 0, 0, 1, 1]),
        (False, [3, S, 4, E, 5], [1, 1, 1, 1, 1]),  # did not open with <think>: all answer
        (False, [S, 1, S, E, 2], [0, 0, 0, 0, 1]),
        (True, [1, 2, E, 3], [0, 0, 0, 1]),
        (True, [S, 1, E, 3, E], [0, 0, 0, 1, 1]),
        (True, [1, 2, 3], [0, 0, 0]),  # never closed
    ],
)
def test_the_tracker_says_which_tokens_are_the_answers(
    opens_inside: bool, tokens: list[int], answer: list[int]
) -> None:
    tracker = ReasoningTracker(ReasoningTokens(start=S, end=E, opens_inside=opens_inside))
    assert tracker.may_open is not opens_inside
    assert tracker.answering is not opens_inside
    assert [int(tracker.accept(t)) for t in tokens] == answer
    assert not tracker.may_open
    assert tracker.answering == bool(answer[-1])
