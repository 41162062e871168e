"""Detokenization per token, by read path: the byte table, DecodeStream, the window decode.

Streams the ids of many pieces of text through `IncrementalDetokenizer`, one token a step
as the detokenize stage does (the byte table's `append` first, where it has one), and
prints the median CPU µs per token of each read path a tokenizer can take, the paths
alternating between repeats, and whether the streamed text equals `tokenizer.decode`.
Tokenizers: GPT-2's and the bundled SmolLM2's (byte-level BPE; SmolLM2 when its converted
directory is in the flowllm cache) and a SentencePiece-style BPE with byte fallback
(tests/tokenizer_fixtures.py). Run:

    .venv/bin/python benchmarks/detokenize_paths.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_fixtures import write_gpt2_tokenizer_files
from tokenizer_fixtures import build_byte_fallback_tokenizer

from flowllm.messages import SamplingParams
from flowllm.models.bundled import find_bundled_model
from flowllm.text.decode_stream import StreamDecode
from flowllm.text.detokenizer import ByteVocab, Decode, IncrementalDetokenizer, make_decode

ROOT = Path(__file__).resolve().parents[1]
MULTILINGUAL = [
    "日本語のテキストと English mixed: 東京は大きい。",
    "Ünïcödé façade, naïve coöperation — “quotes” … ½ ¼ ∑ ∞ ≠",
    "Ελληνικά και русский текст, עברית, العربية, हिन्दी, 한국어",
    "Emoji time 😀🎉👍🏽 and flags 🇫🇷🇯🇵!",
]


def pieces(tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) pairs from README.md and multilingual lines: a line as the
    prompt, the lines after it as the output, each encoded whole (cut at characters)."""
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.strip()]
    lines += MULTILINGUAL * 20
    work = []
    for i in range(0, len(lines) - 8, 8):
        prompt = tokenizer.encode(lines[i], add_special_tokens=False)
        output = tokenizer.encode("\n".join(lines[i + 1 : i + 8]), add_special_tokens=False)
        work.append((prompt, output))
    return work


def paths(tokenizer: Any) -> dict[str, Decode]:
    """The decode of each read path this tokenizer can take."""
    stream = make_decode(tokenizer, True, True)
    assert isinstance(stream, StreamDecode)
    found: dict[str, Decode] = {"window": stream.decode, "stream": stream}
    table = ByteVocab.of(tokenizer)
    if table is not None:
        found["table"] = make_decode(tokenizer, True, True, table)
    return found


def run(tokenizer: Any, decode: Decode, work: list[tuple[list[int], list[int]]]) -> float:
    """CPU seconds to stream every piece, one token a step."""
    params = SamplingParams()
    started = time.thread_time()
    for prompt, output in work:
        detok = IncrementalDetokenizer(tokenizer, prompt, params, decode=decode)
        append, step = detok.append, detok.step_token
        for token_id in output:
            if append(token_id) is None:
                step(token_id)
        detok.finish()
    return time.thread_time() - started


def exact(tokenizer: Any, decode: Decode, work: list[tuple[list[int], list[int]]]) -> bool:
    """Does every piece's streamed text equal the decode of prompt and output, less the
    prompt's text?"""
    for prompt, output in work:
        detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(), decode=decode)
        text = "".join(detok.step_token(t).text_delta for t in output) + detok.finish().text_delta
        whole, before = tokenizer.decode(prompt + output), tokenizer.decode(prompt)
        if text != whole[len(before) :]:
            return False
    return True


def tokenizers(tmp: Path) -> dict[str, Callable[[], Any]]:
    from transformers import AutoTokenizer

    write_gpt2_tokenizer_files(tmp / "gpt2")
    found: dict[str, Callable[[], Any]] = {
        "gpt2": lambda: AutoTokenizer.from_pretrained(str(tmp / "gpt2")),
        "byte-fallback": lambda: build_byte_fallback_tokenizer(tmp),
    }
    smollm2 = find_bundled_model()
    if smollm2 is not None:
        found["smollm2"] = lambda: AutoTokenizer.from_pretrained(str(smollm2))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print("median CPU µs per token, one token a step; exact: the text equals the full decode")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        (tmp / "gpt2").mkdir()
        for label, load in tokenizers(tmp).items():
            tokenizer = load()
            work = pieces(tokenizer)
            count = sum(len(output) for _, output in work)
            decodes = paths(tokenizer)
            times: dict[str, list[float]] = {path: [] for path in decodes}
            for _ in range(args.repeats):
                for path, decode in decodes.items():
                    times[path].append(run(tokenizer, decode, work) / count)
            for path, decode in decodes.items():
                median = sorted(times[path])[len(times[path]) // 2]
                same = "yes" if exact(tokenizer, decode, work) else "no"
                print(
                    f"{label:>14} {path:>7} {median * 1e6:7.2f} µs  exact: {same}  ({count} tokens)"
                )


if __name__ == "__main__":
    main()
