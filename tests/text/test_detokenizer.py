"""Incremental detokenizer against `tokenizer.decode` of the whole output, with the real
GPT-2 tokenizer, the bundled SmolLM2's and a SentencePiece-style one with byte fallback:
random sequences with split multi-byte characters, stop strings that span tokens, special
tokens, and the stop-token rule; each read path (the byte table, `DecodeStream`, the window
decode)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tokenizer_fixtures import build_byte_fallback_tokenizer

from flowllm.messages import SamplingParams
from flowllm.text.decode_stream import StreamDecode
from flowllm.text.detokenizer import (
    ByteVocab,
    Decode,
    DetokenizerStep,
    IncrementalDetokenizer,
    make_decode,
)

EOT = 50256  # <|endoftext|>

TEXTS = [
    "Hello world, the café serves crème brûlée.",
    "日本語のテキストと English mixed: 東京は大きい。",
    "Emoji time 😀🎉👍🏽 and flags 🇫🇷🇯🇵!",
    "Ünïcödé façade, naïve coöperation — “quotes” … ½ ¼ ∑ ∞ ≠",
    "Ελληνικά και русский текст, עברית, العربية, हिन्दी, 한국어",
    "Code: def f(x):\n    return x ** 2  # 🐍\n\n\ttabs\tand  double  spaces",
]


def stream(
    detok: IncrementalDetokenizer, ids: list[int], rng: random.Random, *, max_chunk: int = 3
) -> tuple[list[DetokenizerStep], DetokenizerStep]:
    """Feed ids in random chunks of 1..max_chunk; return the steps and the finish step."""
    steps = []
    i = 0
    while i < len(ids) and not detok.finished:
        n = rng.randint(1, max_chunk)
        steps.append(detok.step(ids[i : i + n]))
        i += n
    return steps, detok.finish()


def joined(steps: list[DetokenizerStep], last: DetokenizerStep) -> str:
    return "".join(s.text_delta for s in steps) + last.text_delta


def pools_of(tokenizer: Any) -> dict[str, list[int]]:
    """Token ids of multi-byte text (many are partial UTF-8 on their own), the special
    tokens, and the vocabulary's size."""
    multi = sorted({t for text in TEXTS for t in tokenizer.encode(text)})
    partial = [t for t in multi if "\ufffd" in tokenizer.decode([t])]
    assert len(partial) > 20  # the pool really contains split characters
    return {"multi": multi, "partial": partial, "special": tokenizer.all_special_ids,
            "size": [len(tokenizer)]}  # fmt: skip


@pytest.fixture(scope="module")
def pools(gpt2_tokenizer: Any) -> dict[str, list[int]]:
    return pools_of(gpt2_tokenizer)


def window_decode(tokenizer: Any, params: SamplingParams) -> Decode:
    """The decode of the window path: no byte table, no stream."""
    decode = make_decode(
        tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
    )
    return decode.decode if isinstance(decode, StreamDecode) else decode


def random_sequence(rng: random.Random, tokenizer: Any, pools: dict[str, list[int]]) -> list[int]:
    kind = rng.random()
    if kind < 0.4:
        # real text (no U+FFFD in its decode), cut at a random token
        text = " ".join(rng.sample(TEXTS, k=rng.randint(1, 3)))
        ids = tokenizer.encode(text)
        return ids[rng.randint(0, len(ids) // 3) :][: rng.randint(1, 100)]
    if kind < 0.8:
        # a soup of partial-character tokens, text tokens and the odd <|endoftext|>
        n = rng.randint(1, 80)
        return [
            rng.choice(pools["special"])
            if rng.random() < 0.05
            else rng.choice(pools["partial"] if rng.random() < 0.5 else pools["multi"])
            for _ in range(n)
        ]
    # anything at all from the vocabulary
    return [rng.randrange(pools["size"][0]) for _ in range(rng.randint(1, 60))]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_the_full_decode(
    gpt2_tokenizer: Any, pools: dict[str, list[int]], skip_special_tokens: bool
) -> None:
    rng = random.Random(1234 + skip_special_tokens)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    with_fffd = 0
    for case in range(200):
        ids = random_sequence(rng, gpt2_tokenizer, pools)
        prompt = gpt2_tokenizer.encode(rng.choice(TEXTS)) if case % 2 else []
        detok = IncrementalDetokenizer(gpt2_tokenizer, prompt, params)
        steps, last = stream(detok, ids, rng)
        full = gpt2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        got = joined(steps, last)
        assert got == full, (case, ids)
        assert detok.text == full
        assert detok.num_output_tokens == len(ids)
        # a character is emitted whole: a delta has U+FFFD only where the full decode does
        assert got.count("\ufffd") == full.count("\ufffd")
        with_fffd += "\ufffd" in full
    assert 20 < with_fffd < 180  # both clean and broken byte streams were exercised


def test_split_characters_are_emitted_once_whole(gpt2_tokenizer: Any) -> None:
    ids = gpt2_tokenizer.encode("a😀b日本c")
    detok = IncrementalDetokenizer(gpt2_tokenizer, [], SamplingParams())
    deltas = [detok.step([t]).text_delta for t in ids]
    assert "".join(deltas) == "a😀b日本c"
    assert "😀" in deltas or any("😀" in d for d in deltas)
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens only carried part of a character


def test_prompt_context_and_a_prompt_ending_inside_a_character(gpt2_tokenizer: Any) -> None:
    emoji = gpt2_tokenizer.encode(" 😀")
    assert len(emoji) >= 2
    out = gpt2_tokenizer.encode(" and more")
    prompt = gpt2_tokenizer.encode("Say") + emoji[:-1]  # the prompt ends mid-character
    detok = IncrementalDetokenizer(gpt2_tokenizer, prompt, SamplingParams())
    text = joined([detok.step(emoji[-1:] + out)], detok.finish())
    assert text == gpt2_tokenizer.decode(emoji[-1:] + out)  # starts with U+FFFD, as decode
    detok = IncrementalDetokenizer(
        gpt2_tokenizer, gpt2_tokenizer.encode("Say hi"), SamplingParams()
    )
    assert joined([detok.step(out)], detok.finish()) == " and more"


def test_invalid_bytes_are_flushed_at_finish(gpt2_tokenizer: Any) -> None:
    ids = gpt2_tokenizer.encode("x😀")[:-1]  # ends inside the emoji
    detok = IncrementalDetokenizer(gpt2_tokenizer, [], SamplingParams())
    streamed = detok.step(ids).text_delta
    assert streamed == "x"
    assert streamed + detok.finish().text_delta == gpt2_tokenizer.decode(ids)


def test_special_tokens_skipped_or_kept(gpt2_tokenizer: Any) -> None:
    ids = [*gpt2_tokenizer.encode("one"), EOT, *gpt2_tokenizer.encode(" two"), EOT, EOT]
    for skip, spaces in ((True, True), (False, True), (False, False), (True, False)):
        params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        detok = IncrementalDetokenizer(gpt2_tokenizer, [], params)
        got = joined([detok.step([t]) for t in ids], detok.finish())
        want = gpt2_tokenizer.decode(
            ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces
        )
        assert got == want
        assert got == ("one two" if skip else "one<|endoftext|> two<|endoftext|><|endoftext|>")


def test_stop_terminating_token_text_is_left_out_unless_included(gpt2_tokenizer: Any) -> None:
    ids = gpt2_tokenizer.encode("Done.")
    for include, want in ((False, "Done"), (True, "Done.")):
        params = SamplingParams(include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(gpt2_tokenizer, [], params)
        got = [detok.step(ids[:-1]), detok.step(ids[-1:], stop_terminated=True), detok.finish()]
        assert joined(got[:-1], got[-1]) == want
        assert detok.num_output_tokens == len(ids)
    detok = IncrementalDetokenizer(gpt2_tokenizer, [], SamplingParams(skip_special_tokens=False))
    got = [detok.step([*ids, EOT], stop_terminated=True), detok.finish()]
    assert joined(got[:-1], got[-1]) == "Done."


# ------------------------------------------------------------------------- stop strings


def held_oracle(text: str, stops: list[str]) -> int:
    """Longest suffix of text that is a proper prefix of a stop string (plain loop)."""
    best = 0
    for s in stops:
        for k in range(1, len(s)):
            if len(text) >= k and text[-k:] == s[:k]:
                best = max(best, k)
    return best


def test_stop_string_spanning_tokens_is_cut_and_reported(gpt2_tokenizer: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog. Then more text."
    ids = gpt2_tokenizer.encode(text)
    stop = "fox jum"  # starts mid-token and spans three tokens
    for include, want in ((False, "The quick brown "), (True, "The quick brown fox jum")):
        params = SamplingParams(stop=("never", stop), include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(gpt2_tokenizer, [], params)
        emitted = ""
        result = None
        for n, t in enumerate(ids):
            out = detok.step([t])
            emitted += out.text_delta
            if out.stop_string is not None:
                result = out
                break
            # only what could still start a stop string is held back
            sofar = gpt2_tokenizer.decode(ids[: n + 1])
            assert emitted == sofar[: len(sofar) - held_oracle(sofar, ["never", stop])]
        assert result is not None and result.stop_string == stop
        assert emitted == want
        assert detok.finished and detok.stop_string == stop
        assert detok.step(ids[-2:]) == DetokenizerStep("")
        assert detok.finish() == DetokenizerStep("")


def test_stop_strings_with_split_characters(gpt2_tokenizer: Any) -> None:
    ids = gpt2_tokenizer.encode("Tokyo is 東京, Japan is 日本 indeed")
    params = SamplingParams(stop=("日本",))
    detok = IncrementalDetokenizer(gpt2_tokenizer, [], params)
    steps, last = stream(detok, ids, random.Random(0), max_chunk=1)
    assert joined(steps, last) == "Tokyo is 東京, Japan is "
    assert [s.stop_string for s in steps if s.stop_string] == ["日本"]


def test_the_stop_string_that_completes_first_wins(gpt2_tokenizer: Any) -> None:
    ids = gpt2_tokenizer.encode("abcdef ghij")
    params = SamplingParams(stop=("cdef", "bcd", "abcdefgh"), include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(gpt2_tokenizer, [], params)
    out = detok.step(ids)  # everything in one step: "bcd" completes before "cdef"
    assert out == DetokenizerStep("abcd", "bcd")


def test_random_stop_strings_against_the_full_text(
    gpt2_tokenizer: Any, pools: dict[str, list[int]]
) -> None:
    rng = random.Random(77)
    for case in range(200):
        ids = random_sequence(rng, gpt2_tokenizer, pools)
        full = gpt2_tokenizer.decode(ids, skip_special_tokens=True)
        stops: list[str] = []
        for _ in range(rng.randint(1, 3)):
            if full and rng.random() < 0.7:
                a = rng.randrange(len(full))
                stops.append(full[a : a + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(["zzz", "\n\n", "😀😀", "END"]))
        include = rng.random() < 0.5
        params = SamplingParams(stop=tuple(stops), include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(gpt2_tokenizer, [], params)
        steps, last = stream(detok, ids, rng)
        got = joined(steps, last)
        # oracle: the match that ends first in the whole text (then the one starting first)
        matches = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
        if not matches:
            assert got == full, case
            assert detok.stop_string is None
            continue
        end, begin, s = min(matches)
        assert got == (full[:end] if include else full[:begin]), (case, stops)
        assert detok.stop_string == s
        reported = [x.stop_string for x in [*steps, last] if x.stop_string]
        assert reported == [s]


def test_spaces_between_special_tokens_for_a_decoder_that_joins_with_spaces() -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["<a>", "<b>"]})
    a, b = tok.convert_tokens_to_ids(["<a>", "<b>"])
    ids = [1, a, b, 2, 1]
    assert tok.decode(ids) == "hello <a> <b> world hello"
    cases = {
        (False, True): "hello <a> <b> world hello",
        (False, False): "hello<a><b>world hello",
        (True, True): "hello world hello",
        (True, False): "hello world hello",  # skipped specials split nothing (vLLM)
    }
    for (skip, spaces), want in cases.items():
        params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        detok = IncrementalDetokenizer(tok, [], params)
        assert joined([detok.step([t]) for t in ids], detok.finish()) == want


@pytest.fixture(scope="module")
def byte_vocab(gpt2_tokenizer: Any) -> ByteVocab:
    vocab = ByteVocab.of(gpt2_tokenizer)
    assert vocab is not None  # GPT-2's decoder is ByteLevel
    return vocab


def test_byte_table_decode_equals_tokenizer_decode(
    gpt2_tokenizer: Any, pools: dict[str, list[int]], byte_vocab: ByteVocab
) -> None:
    """Every id alone, then random windows (split characters, invalid UTF-8, specials)."""
    assert byte_vocab.added == {EOT}
    fast = make_decode(gpt2_tokenizer, True, True, byte_vocab)
    for i in range(len(gpt2_tokenizer)):
        assert fast([i]) == gpt2_tokenizer.decode([i], skip_special_tokens=True), i
    rng = random.Random(5)
    for skip in (True, False):
        fast = make_decode(gpt2_tokenizer, skip, True, byte_vocab)
        for _ in range(800):
            ids = random_sequence(rng, gpt2_tokenizer, pools)[:12]
            assert fast(ids) == gpt2_tokenizer.decode(ids, skip_special_tokens=skip), ids
    assert fast([len(gpt2_tokenizer) + 5]) == ""  # past the table: the backend's answer


def test_the_byte_table_changes_no_delta(
    gpt2_tokenizer: Any, pools: dict[str, list[int]], byte_vocab: ByteVocab
) -> None:
    rng = random.Random(6)
    for case in range(150):
        params = SamplingParams(
            skip_special_tokens=case % 2 == 0,
            spaces_between_special_tokens=case % 4 < 2,
            stop=("ab", "の") if case % 3 == 0 else (),
        )
        fast = make_decode(
            gpt2_tokenizer,
            params.skip_special_tokens,
            params.spaces_between_special_tokens,
            byte_vocab,
        )
        ids = random_sequence(rng, gpt2_tokenizer, pools)
        if case % 5 == 0:  # an id past the tokenizer's table (a model with a padded vocab)
            ids.insert(rng.randrange(len(ids) + 1), len(gpt2_tokenizer) + 3)
        prompt = gpt2_tokenizer.encode(rng.choice(TEXTS)) if case % 2 else []
        chunks_seed = rng.random()
        plain = IncrementalDetokenizer(
            gpt2_tokenizer, prompt, params, decode=window_decode(gpt2_tokenizer, params)
        )
        table = IncrementalDetokenizer(gpt2_tokenizer, prompt, params, decode=fast)
        assert stream(plain, ids, random.Random(chunks_seed)) == stream(
            table, ids, random.Random(chunks_seed)
        )


def test_only_byte_level_tokenizers_get_a_byte_table() -> None:
    assert ByteVocab.of(object()) is None


def test_step_token_is_step_of_one(gpt2_tokenizer: Any, pools: dict[str, list[int]]) -> None:
    rng = random.Random(8)
    for case in range(60):
        params = SamplingParams(
            stop=("ab", "の") if case % 3 == 0 else (), include_stop_str_in_output=case % 4 == 0
        )
        ids = random_sequence(rng, gpt2_tokenizer, pools)
        lists = IncrementalDetokenizer(gpt2_tokenizer, [], params)
        ones = IncrementalDetokenizer(gpt2_tokenizer, [], params)
        for k, t in enumerate(ids):
            last = k == len(ids) - 1 and case % 2 == 0
            assert lists.step([t], stop_terminated=last) == ones.step_token(t, stop_terminated=last)
        assert lists.finish() == ones.finish()
        assert lists.num_output_tokens == ones.num_output_tokens


def test_append_streams_the_full_decode(
    gpt2_tokenizer: Any, pools: dict[str, list[int]], byte_vocab: ByteVocab
) -> None:
    """The one-token fast path, with `step_token` where it does not answer: the text so far
    is always a prefix of the full decode and ends equal to it, a character is emitted
    whole, most tokens of real text take the fast path, and with stop strings none does."""
    rng = random.Random(9)
    answered = asked = 0
    for case in range(200):
        params = SamplingParams(
            skip_special_tokens=case % 2 == 0, stop=("ab",) if case % 10 == 0 else ()
        )
        fast = make_decode(gpt2_tokenizer, params.skip_special_tokens, True, byte_vocab)
        ids = random_sequence(rng, gpt2_tokenizer, pools)
        prompt = gpt2_tokenizer.encode(rng.choice(TEXTS)) if case % 2 else []
        plain = IncrementalDetokenizer(gpt2_tokenizer, prompt, params)
        table = IncrementalDetokenizer(gpt2_tokenizer, prompt, params, decode=fast)
        full = gpt2_tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        got = ""
        for t in ids:
            text = table.append(t)
            asked += 1
            if text is None:
                text = table.step_token(t).text_delta
            else:
                answered += 1
                assert not params.stop
            got += text
            assert full.startswith(got) or params.stop, (case, ids)
            plain.step_token(t)
        got += table.finish().text_delta
        assert got == plain.text + plain.finish().text_delta
        assert got == full or params.stop
        assert got.count("\ufffd") == full.count("\ufffd") or params.stop
        assert table.num_output_tokens == plain.num_output_tokens
    assert asked // 3 < answered < asked  # both paths were taken


def test_skipped_special_token_inside_a_character(gpt2_tokenizer: Any) -> None:
    """A skipped special token between the byte tokens of one character leaves it whole."""
    emoji = gpt2_tokenizer.encode("😀")
    assert len(emoji) > 1
    ids = [*gpt2_tokenizer.encode("a"), emoji[0], EOT, *emoji[1:], *gpt2_tokenizer.encode("b")]
    for spaces in (True, False):
        params = SamplingParams(skip_special_tokens=True, spaces_between_special_tokens=spaces)
        detok = IncrementalDetokenizer(gpt2_tokenizer, [], params)
        assert joined([detok.step([t]) for t in ids], detok.finish()) == "a😀b"


# ------------------------------------------------------------------------- other tokenizers


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.mark.parametrize("path", ["stream", "table"])
def test_smollm2_streams_the_full_decode(smollm2_tokenizer: Any, path: str) -> None:
    """The bundled model's byte-level tokenizer, through `DecodeStream` (any fast tokenizer
    can) and through the byte table (what the detokenize stage takes for it)."""
    tok = smollm2_tokenizer
    pools = pools_of(tok)
    table = ByteVocab.of(tok)
    assert table is not None
    rng = random.Random(21)
    for case in range(150):
        params = SamplingParams(skip_special_tokens=case % 2 == 0)
        decode = make_decode(
            tok, params.skip_special_tokens, True, table if path == "table" else None
        )
        assert isinstance(decode, StreamDecode) == (path == "stream")
        ids = random_sequence(rng, tok, pools)
        prompt = tok.encode(rng.choice(TEXTS)) if case % 3 else []
        detok = IncrementalDetokenizer(tok, prompt, params, decode=decode)
        got = joined(*stream(detok, ids, rng))
        full = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
        assert got == full, (case, ids)
        assert got.count("\ufffd") == full.count("\ufffd")


def clean_sequence(rng: random.Random, tok: Any, skip_special_tokens: bool) -> list[int]:
    """Pieces of the texts cut at characters, encoded: valid UTF-8 across the byte tokens
    (byte fallback decodes a run of bytes as a whole, so a byte that is not UTF-8 turns its
    neighbours to U+FFFD too, a change no incremental decode can foresee); special tokens
    between the pieces, and inside a character when they are skipped (a special token
    kept ends a run of bytes); an id the tokenizer lacks."""
    pieces: list[list[int]] = []
    for _ in range(rng.randint(1, 4)):
        text = rng.choice(TEXTS)
        begin = rng.randrange(len(text))
        piece = text[begin : begin + rng.randint(1, 30)]
        pieces.append(tok.encode(piece, add_special_tokens=False))
    for _ in range(rng.randint(0, 3)):
        piece = rng.choice(pieces)
        at = rng.randint(0, len(piece)) if skip_special_tokens else rng.choice([0, len(piece)])
        piece.insert(at, rng.choice([tok.bos_token_id, tok.eos_token_id]))
    ids = [t for piece in pieces for t in piece]
    if rng.random() < 0.2:
        ids.insert(rng.randint(0, len(ids)), len(tok) + 7)
    return ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_byte_fallback_tokenizer_streams_the_full_decode(
    tmp_path: Path, skip_special_tokens: bool
) -> None:
    """Split characters come out whole and once, the continuation of the prompt keeps its
    leading space, and stop strings cut where the full text has them."""
    tok = build_byte_fallback_tokenizer(tmp_path)
    assert ByteVocab.of(tok) is None
    assert isinstance(make_decode(tok, skip_special_tokens, True), StreamDecode)
    rng = random.Random(31 + skip_special_tokens)
    split = 0
    for case in range(300):
        stop = ("本", "é i") if case % 4 == 0 else ()
        params = SamplingParams(skip_special_tokens=skip_special_tokens, stop=stop)
        ids = clean_sequence(rng, tok, skip_special_tokens)
        prompt = tok.encode(rng.choice(TEXTS), add_special_tokens=False) if case % 2 else []
        detok = IncrementalDetokenizer(tok, prompt, params)
        got = joined(*stream(detok, ids, rng))
        before = tok.decode(prompt, skip_special_tokens=skip_special_tokens)
        whole = tok.decode(prompt + ids, skip_special_tokens=skip_special_tokens)
        assert whole.startswith(before)
        full = whole[len(before) :]
        found = [(full.find(s) + len(s), full.find(s)) for s in stop if s in full]
        if found:  # cut before the stop string that completes first
            full = full[: min(found)[1]]
        assert got == full, (case, tok.convert_ids_to_tokens(ids))
        split += any((t or "").startswith("<0x") for t in tok.convert_ids_to_tokens(ids))
    assert split > 100  # characters from byte tokens were exercised


def test_a_byte_that_breaks_sent_text_restarts_the_stream(tmp_path: Path) -> None:
    """An invalid byte joining a run of byte tokens turns the run to U+FFFD in the full
    decode, text already sent included: the stream goes on, the sent text stays, and the
    text after the run is exact."""
    tok = build_byte_fallback_tokenizer(tmp_path)
    stray = tok.convert_tokens_to_ids("<0xBA>")  # a continuation byte after a whole "é"
    after = tok.encode(" Tokyo is 東京", add_special_tokens=False)
    ids = [*tok.encode("café", add_special_tokens=False), stray, *after]
    assert tok.decode(ids).startswith("caf\ufffd\ufffd\ufffd")  # é's bytes are U+FFFD now
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    got = joined(*stream(detok, ids, random.Random(3)))
    assert got == "café" + tok.decode([stray, *after])  # == "café\ufffd  Tokyo is 東京"


def test_without_a_decode_stream_the_window_decodes(
    gpt2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `tokenizers` without DecodeStream(ids=...) (before 0.22): the window decode."""
    import flowllm.text.detokenizer as detokenizer

    monkeypatch.setattr(detokenizer, "can_stream", lambda: False)
    decode = make_decode(gpt2_tokenizer, True, True)
    assert not isinstance(decode, StreamDecode)
    ids = gpt2_tokenizer.encode("a😀b 日本")
    detok = IncrementalDetokenizer(gpt2_tokenizer, [], SamplingParams())
    assert joined([detok.step([t]) for t in ids], detok.finish()) == "a😀b 日本"
