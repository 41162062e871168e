"""Quality of a GGUF model served quantized against the same weights dequantized to float32,
and against llama.cpp's own perplexity of the same file.

The quantized kernels keep the file's weights exactly and round each block of 32
activations to int8 (as llama.cpp does; `flowllm/kernels/csrc/quant.c`), every row of
every step the same way. This script measures what that costs, against the float32 model
with the file's values:

- perplexity of a fixed text (below), the prompt's own logprobs, with float32 and with bf16
  activations (`--dtype auto` picks bf16 on CPUs with AVX512-BF16);
- greedy agreement: the share of generated tokens equal to the reference's, position by
  position, and how many tokens come before the first difference, over a set of prompts;
- with `--text FILE`, perplexity as llama.cpp's `llama-perplexity -c CTX` computes it: the
  file's tokens cut into windows of CTX, each scored on its second half; with
  `--llama-perplexity BIN` that binary's figure on the same file and model beside it.

The same weights dequantized to bf16 give the scale: how far rounding the activations
alone moves a model this small.

    .venv/bin/python benchmarks/quant_quality.py                     # the bundled Q4_1 file
    .venv/bin/python benchmarks/quant_quality.py --model path/to/model.gguf --max-tokens 64
    .venv/bin/python benchmarks/quant_quality.py --text /usr/share/common-licenses/GPL-3 \
        --ctx 256 --llama-perplexity path/to/llama.cpp/build/bin/llama-perplexity

For scale: llama.cpp's own figures put Q4_1 against fp16 at +0.1 to +0.3 perplexity on
7B models' wikitext (its quantize README), i.e. the weights' quantization, which both
models here share.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowllm import LLM, SamplingParams
from flowllm.config import BUNDLED_MODEL
from flowllm.models.bundled import bundled_gguf_path

# The opening of "Alice's Adventures in Wonderland" (Lewis Carroll, 1865; public domain).
TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of "
    "having nothing to do: once or twice she had peeped into the book her sister was "
    "reading, but it had no pictures or conversations in it, 'and what is the use of a "
    "book,' thought Alice 'without pictures or conversations?' So she was considering in "
    "her own mind (as well as she could, for the hot day made her feel very sleepy and "
    "stupid), whether the pleasure of making a daisy-chain would be worth the trouble of "
    "getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran "
    "close by her. There was nothing so very remarkable in that; nor did Alice think it so "
    "very much out of the way to hear the Rabbit say to itself, 'Oh dear! Oh dear! I shall "
    "be late!' (when she thought it over afterwards, it occurred to her that she ought to "
    "have wondered at this, but at the time it all seemed quite natural); but when the "
    "Rabbit actually took a watch out of its waistcoat-pocket, and looked at it, and then "
    "hurried on, Alice started to her feet, for it flashed across her mind that she had "
    "never before seen a rabbit with either a waistcoat-pocket, or a watch to take out of "
    "it, and burning with curiosity, she ran across the field after it, and fortunately was "
    "just in time to see it pop down a large rabbit-hole under the hedge."
)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The most important thing about learning a language is",
    "In 1969, the first humans",
    "A good recipe for pancakes needs",
]


def perplexity(llm: LLM, text: str) -> tuple[float, int]:
    """exp(-mean logprob) of the text's tokens after the first, and how many there are."""
    out = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    logprobs = [t.logprob for t in (out.prompt_logprobs or []) if t is not None]
    return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs)


def windowed_perplexity(llm: LLM, text: str, ctx: int) -> tuple[float, int]:
    """llama-perplexity's figure: the text's tokens in windows of `ctx`, each scoring the
    tokens of its second half from their own prefix; (perplexity, tokens scored)."""
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = [ids[i : i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll = [-t.logprob for o in outs for t in (o.prompt_logprobs or [])[ctx // 2 + 1 :]]
    return math.exp(sum(nll) / len(nll)), len(nll)


def llama_perplexity(binary: str, model: str, text_file: str, ctx: int) -> str:
    """llama-perplexity's final estimate on the same file and windows (2 threads; without
    its repacked weights, whose kernels stopped on an illegal instruction on the AMX CPU
    this was measured on)."""
    run = subprocess.run(
        [binary, "-m", model, "-f", text_file, "-c", str(ctx), "-b", str(ctx), "-t", "2",
         "--no-repack"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = re.search(r"Final estimate: PPL = ([0-9.]+ \+/- [0-9.]+)", run.stdout + run.stderr)
    assert found, run.stderr[-2000:]
    return found.group(1)


def greedy(llm: LLM, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """(share of positions with equal tokens, mean tokens before the first difference)."""
    same = total = 0
    prefix = []
    for a, b in zip(ours, ref, strict=True):
        same += sum(x == y for x, y in zip(a, b, strict=False))
        total += len(b)
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(b))
        prefix.append(first)
    return same / total, sum(prefix) / len(prefix)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=BUNDLED_MODEL, help="a GGUF file or the bundled model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--text", help="a text file for llama-perplexity's windowed figure")
    ap.add_argument("--ctx", type=int, default=256, help="its window (llama-perplexity -c)")
    ap.add_argument("--llama-perplexity", help="llama.cpp's binary, run on the same file")
    args = ap.parse_args()
    rows = []
    reference: list[list[int]] | None = None
    variants = [
        ("float32, dequantized (reference)", {"quantization": "none", "dtype": "float32"}),
        ("bfloat16, dequantized (for scale)", {"quantization": "none", "dtype": "bfloat16"}),
        ("quantized, float32 activations", {"dtype": "float32"}),
        ("quantized, bf16 activations", {"dtype": "bfloat16"}),
    ]
    text = Path(args.text).read_text() if args.text else None
    for name, kwargs in variants:
        llm = LLM(args.model, max_model_len=2048, **kwargs)  # type: ignore[arg-type]
        ppl, n = perplexity(llm, TEXT)
        tokens = greedy(llm, args.max_tokens)
        if reference is None:
            reference = tokens
        same, prefix = agreement(tokens, reference)
        row = f"| {name} | {ppl:.4f} | {n} | {same:.1%} | {prefix:.1f} |"
        if text is not None:
            wppl, wn = windowed_perplexity(llm, text, args.ctx)
            row += f" {wppl:.4f} ({wn} tokens) |"
        rows.append(row)
        print(rows[-1], flush=True)
        del llm
    print(f"\nmodel {args.model}; {len(PROMPTS)} prompts x {args.max_tokens} greedy tokens\n")
    print("| weights | perplexity of the text | tokens | greedy tokens equal | "
          "tokens before the first difference |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    print("\n".join(rows))
    if args.llama_perplexity and args.text:
        model = args.model if args.model.endswith(".gguf") else str(bundled_gguf_path())
        ppl = llama_perplexity(args.llama_perplexity, model, args.text, args.ctx)
        print(f"\nllama-perplexity -c {args.ctx} on {args.text}: {ppl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
