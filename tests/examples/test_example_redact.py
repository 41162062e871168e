"""examples/graphs/redact.yaml: listed words masked in streamed and non-streamed output,
including words split across chunks, with usage unchanged.

The oracle is a plain word-by-word masking of the whole text (`oracle_mask`); the stage's
streaming logic must give the same text whatever the chunk boundaries.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import yaml
from example_server import EXAMPLES, MODEL_NAME, copy_graph, load_example_stage_module, stage_entry
from hypothesis import given, settings
from hypothesis import strategies as st
from server_process import ServerProcess

from flowllm.graph.problems import GraphValidationError
from flowllm.graph.spec import GraphSpec
from flowllm.graph.validator import validate_graph
from flowllm.messages import Chunk, TextDeltas

REDACT_YAML = EXAMPLES / "graphs" / "redact.yaml"


redact = load_example_stage_module("redact")


def oracle_mask(text: str, words: list[str], mask: str = "*", ignore_case: bool = True) -> str:
    """Split into runs of word characters and the rest; mask the runs that are listed."""
    listed = {w.lower() for w in words} if ignore_case else set(words)
    out = []
    for piece in re.split(r"(\w+)", text):
        key = piece.lower() if ignore_case else piece
        if piece and key in listed:
            piece = mask * len(piece) if len(mask) == 1 else mask
        out.append(piece)
    return "".join(out)


def stream_through(redactor: Any, pieces: list[str]) -> list[str]:
    state = redact.StreamState()
    return [
        redactor.feed(state, piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)
    ]


# -- the masking rules ----------------------------------------------------------------------

WORDS = ["sec", "secret", "pass", "password", "Ünïcode"]


def test_whole_words_only_and_case_insensitive() -> None:
    r = redact.Redactor(redact.RedactParams(words=("secret", "password")))
    text = "Secret! secretary PASSWORD password1 my_secret secret."
    assert r.redact(text) == "******! secretary ******** password1 my_secret ******."
    assert r.redact(text) == oracle_mask(text, ["secret", "password"])


def test_word_split_across_chunks_is_masked() -> None:
    r = redact.Redactor(redact.RedactParams(words=("secret",)))
    out = stream_through(r, ["The", " sec", "ret", " is", " out"])
    # "sec" waits for "ret"; "secret" waits for " is" (it could still become "secretary")
    assert out == ["The", " ", "", "****** is", " out"]


def test_text_that_cannot_become_a_word_is_not_delayed() -> None:
    r = redact.Redactor(redact.RedactParams(words=("secret",)))
    assert stream_through(r, [" hello", "world", " sec", "tor", "s"]) == [
        " hello", "world", " ", "sector", "s",
    ]  # fmt: skip


def test_a_listed_word_inside_a_longer_word_stays() -> None:
    r = redact.Redactor(redact.RedactParams(words=("secret",)))
    assert "".join(stream_through(r, [" secret", "ary", " secret"])) == " secretary ******"


def test_replacement_mask_and_case_sensitive() -> None:
    r = redact.Redactor(redact.RedactParams(words=("Bob",), mask="[gone]", ignore_case=False))
    assert (
        "".join(stream_through(r, ["Bo", "b met bob and B", "ob"])) == "[gone] met bob and [gone]"
    )


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="secrtpawodÜnïÏC _.,-é1", max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=12),
    ignore_case=st.booleans(),
)
def test_any_chunking_gives_the_whole_text_masked(
    text: str, cuts: list[int], ignore_case: bool
) -> None:
    r = redact.Redactor(redact.RedactParams(words=tuple(WORDS), ignore_case=ignore_case))
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    assert "".join(stream_through(r, pieces)) == oracle_mask(text, WORDS, ignore_case=ignore_case)


def test_bad_params_are_refused_by_the_validator() -> None:
    text = REDACT_YAML.read_text().replace("[secret, password, swordfish]", "[secret, pass word]")
    with pytest.raises(GraphValidationError) as info:
        validate_graph(GraphSpec.from_yaml(text, base_dir=REDACT_YAML.parent))
    message = str(info.value)
    assert "stage 'redact' (Redact)" in message and "'pass word'" in message
    text = REDACT_YAML.read_text().replace("words: [secret, password, swordfish]", "")
    with pytest.raises(GraphValidationError, match=r"missing required param 'words'"):
        validate_graph(GraphSpec.from_yaml(text, base_dir=REDACT_YAML.parent))


# -- the stage: chunk structure, per-choice state, requests that leave early ---------------


class _Mailboxes:
    def __init__(self, open_ids: set[str]) -> None:
        self.open_ids = open_ids

    def get(self, request_id: str) -> object | None:
        return object() if request_id in self.open_ids else None


class _Services:
    def __init__(self, mailboxes: _Mailboxes) -> None:
        self.mailboxes = mailboxes


class _Ctx:
    def __init__(self) -> None:
        self.sent: list[TextDeltas] = []

    async def emit(self, port: str, message: TextDeltas) -> None:
        assert port == "out"
        self.sent.append(message)


def _chunk(rid: str, index: int, text: str, n: int, finish: str | None = None) -> Chunk:
    return Chunk(
        request_id=rid, index=index, text=text, token_ids=(n,), num_prompt_tokens=3,
        num_output_tokens=n, finish_reason=finish, stop_reason=None,  # type: ignore[arg-type]
    )  # fmt: skip


def test_stage_keeps_chunks_and_separates_choices() -> None:
    mailboxes = _Mailboxes({"a", "b"})
    stage = redact.Redact(redact.RedactParams(words=("secret",)), _Services(mailboxes))
    ctx = _Ctx()
    steps = [
        [_chunk("a", 0, " sec", 1), _chunk("a", 1, " sec", 1), _chunk("b", 0, " se", 1)],
        [_chunk("a", 0, "ret", 2), _chunk("a", 1, "tion", 2), _chunk("b", 0, "cret", 2)],
        [_chunk("a", 0, "!", 3, "length"), _chunk("a", 1, " sec", 3, "stop")],
    ]

    async def run() -> None:
        for i, chunks in enumerate(steps):
            await stage.handle(TextDeltas(step_id=i, chunks=tuple(chunks)), ctx)

    anyio.run(run)
    assert [len(m.chunks) for m in ctx.sent] == [3, 3, 2]
    for sent, given_chunks in zip(ctx.sent, steps, strict=True):
        for out, original in zip(sent.chunks, given_chunks, strict=True):
            assert msgspec.structs.replace(out, text="") == msgspec.structs.replace(
                original, text=""
            )  # every field but the text unchanged
    text = {(c.request_id, c.index): "" for m in ctx.sent for c in m.chunks}
    for m in ctx.sent:
        for c in m.chunks:
            text[c.request_id, c.index] += c.text
    assert text == {("a", 0): " ******!", ("a", 1): " section sec", ("b", 0): " "}
    assert stage.open_streams == 1  # b's choice is still open, holding "secret"
    mailboxes.open_ids.discard("b")  # b is aborted: its state goes at the next sweep
    stage.forget_departed()
    assert stage.open_streams == 0


# -- end to end: the example graph behind a real server --------------------------------------

PROMPT = "The story begins"
SEED = 1
MAX_TOKENS = 24


def _split_words(chunks: list[str]) -> tuple[list[str], list[str]]:
    """Words of the concatenated text spanning >= 2 chunks, and words inside one chunk."""
    owner = [i for i, c in enumerate(chunks) for _ in c]
    text = "".join(chunks)
    split, whole = [], []
    for m in re.finditer(r"\w+", text):
        spans = {owner[k] for k in range(m.start(), m.end())}
        (split if len(spans) > 1 else whole).append(m.group())
    return split, whole


def _stream_text(server: ServerProcess, **kwargs: Any) -> tuple[dict[int, str], list[Any]]:
    texts: dict[int, str] = {}
    events = list(server.client().completions.create(stream=True, **kwargs))
    for event in events:
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts, events


def test_redact_graph_end_to_end(
    default_server: ServerProcess, start_server: Any, tmp_path: Path, gpt2_tokenizer: Any
) -> None:
    request = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0)
    # A first run on the default graph shows which words this model really writes.
    reference = default_server.client().completions.create(n=2, seed=SEED, **request)
    first = default_server.client().completions.create(stream=True, seed=SEED, **request)
    chunks = [e.choices[0].text for e in first if e.choices]
    split, whole = _split_words(chunks)
    assert split and whole, f"the seeded output has no split word: {chunks}"
    shipped = stage_entry(yaml.safe_load(REDACT_YAML.read_text()), "redact")["with"]["words"]
    words = [split[0], whole[0].upper(), split[-1]]

    def add_words(data: dict[str, Any]) -> None:
        stage_entry(data, "redact")["with"]["words"] = [*shipped, *words]

    # The shipped file with the words of this run added to its list.
    server = start_server(copy_graph(REDACT_YAML, tmp_path / "redact.yaml", add_words))

    expected = [oracle_mask(c.text, words) for c in reference.choices]
    assert expected[0] != reference.choices[0].text  # something is masked indeed
    # non-streamed, two choices
    out = server.client().completions.create(n=2, seed=SEED, **request)
    assert [c.text for c in out.choices] == expected
    assert out.usage == reference.usage
    assert [c.finish_reason for c in out.choices] == [c.finish_reason for c in reference.choices]
    # streamed, two choices, usage at the end
    texts, events = _stream_text(
        server, n=2, seed=SEED, stream_options={"include_usage": True}, **request
    )
    assert [texts[0], texts[1]] == expected
    assert events[-1].usage == reference.usage
    finishes = [c.finish_reason for e in events for c in e.choices if c.finish_reason]
    assert sorted(finishes) == sorted(c.finish_reason for c in reference.choices)

    # A client that leaves mid-stream (its request is aborted) does not disturb the next.
    with server.client().completions.create(
        stream=True, model=MODEL_NAME, prompt=PROMPT, max_tokens=200, seed=SEED
    ) as leaving:
        for _, _event in zip(range(3), leaving, strict=False):
            pass
    again = server.client().completions.create(n=2, seed=SEED, **request)
    assert [c.text for c in again.choices] == expected

    # The shipped words: a strong logit bias makes the model write " secret" every time.
    (secret,) = gpt2_tokenizer.encode(" secret")
    forced = dict(
        model=MODEL_NAME, prompt="The", max_tokens=6, temperature=0.0,
        logit_bias={str(secret): 100},
    )  # fmt: skip
    out = server.client().completions.create(**forced)
    assert out.choices[0].text == " ******" * 6
    assert out.usage.completion_tokens == 6
    texts, _ = _stream_text(server, **forced)
    assert texts[0] == " ******" * 6
