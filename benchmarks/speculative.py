"""Speculative decoding (n-gram prompt lookup, a draft model) against none, on the bundled
model.

Workload (grounded, greedy): chat prompts that give a passage of `--passage-tokens` tokens
(English prose: the docstrings of Python's standard library, cut on a token boundary) and
ask to repeat it word for word, or to rewrite it lightly (every other prompt), the case
prompt lookup is made for. Each mode runs in its own `LLM` of the same process, the modes
alternated `--pairs` times (the machine is shared: compare within a pair, report ratios).

- concurrency 1: each prompt alone, in turn; the time per output token is the engine's
  `time_per_output_token_seconds` (first output to last, over the tokens after the first),
  averaged over the requests;
- concurrency N (`--concurrency`): N prompts submitted at once; output tokens over the
  wall time of the call.

Beside each, the process's CPU time per output token (all its threads): on a machine shared
with other work, wall times move with the others' load, CPU time much less.

Modes: `none` (the default graph), `ngram` (the speculative graph, drafts at any batch
size: `disable_by_batch_size` null), `adaptive` (the speculative graph with its default
`disable_by_batch_size`, at concurrency > 1 only), and for each `--draft PATH` a mode
`draft:NAME` (method draft_model with that model, at any batch size; `--draft-quantization
auto,int8` adds `draft:NAME-int8`, its linear layers loaded as int8). Acceptance: accepted /
drafted tokens. Greedy outputs are compared between modes (they must be equal).

    .venv/bin/python benchmarks/speculative.py
    .venv/bin/python benchmarks/speculative.py --pairs 1 --prompts 2 --max-tokens 64 --concurrency 8
    .venv/bin/python benchmarks/speculative.py --prompts 0 --concurrency 16  # where to step aside
    .venv/bin/python benchmarks/truncated_draft.py --layers 4 --out /tmp/smollm2-draft-4
    .venv/bin/python benchmarks/speculative.py --concurrency 0 \
        --draft /tmp/smollm2-draft-4 --draft smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import time
from dataclasses import asdict, dataclass

from transformers import PreTrainedTokenizerBase

from flowllm.config import BUNDLED_MODEL, SpeculativeConfig
from flowllm.llm import LLM
from flowllm.messages import SamplingParams

SOURCES = (
    "argparse", "subprocess", "pickle", "logging", "threading", "email", "json", "typing",
    "dataclasses", "functools", "collections", "contextlib", "asyncio", "unittest", "zipfile",
    "tarfile", "string", "textwrap", "heapq", "bisect", "decimal", "fractions", "statistics",
    "random", "shutil", "tempfile", "socket", "ssl", "http", "sqlite3", "csv", "difflib",
)  # fmt: skip
ASKS = (
    "Repeat the following passage word for word, without any comment.",
    "Rewrite the following passage lightly: keep every sentence in order and change only a "
    "few words.",
)


@dataclass
class Run:
    mode: str
    concurrency: int
    pair: int
    seconds: float
    output_tokens: int
    tokens_per_s: float
    tpot_ms: float  # mean time per output token of a request (concurrency 1)
    cpu_ms_per_token: float  # the process's CPU time (every thread) per output token
    drafted: float
    accepted: float
    load_average: float


def passages(tokenizer: PreTrainedTokenizerBase, count: int, length: int) -> list[str]:
    """`count` distinct passages of `length` tokens by `tokenizer`: consecutive windows of
    the standard library's docstrings (each module's, then its members'), joined as prose."""
    docs: list[str] = []
    for name in SOURCES:
        module = importlib.import_module(name)
        members = [
            module,
            *(getattr(module, m) for m in sorted(vars(module)) if not m.startswith("_")),
        ]
        docs += [doc for m in members if (doc := inspect.getdoc(m)) and len(doc) > 200]
    ids = tokenizer.encode(" ".join(" ".join(docs).split()), add_special_tokens=False)
    if len(ids) < count * length:
        raise SystemExit(f"the docstrings hold {len(ids) // length} passages; ask fewer")
    return [tokenizer.decode(ids[i * length : (i + 1) * length]) for i in range(count)]


def conversations(texts: list[str]) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"{ASKS[i % len(ASKS)]}\n\n{text}"}]
        for i, text in enumerate(texts)
    ]


def metric(llm: LLM, name: str) -> float:
    assert llm.last_run is not None
    return llm.last_run.registry.get_sample_value(name) or 0.0


def run(
    llm: LLM, mode: str, chats: list[list[dict[str, str]]], concurrency: int, pair: int,
    params: SamplingParams,
) -> tuple[Run, list[list[int]]]:  # fmt: skip
    tokens: list[list[int]] = []
    drafted = accepted = tpot_sum = tpot_count = 0.0
    started, cpu = time.perf_counter(), time.process_time()
    for at in range(0, len(chats), concurrency):
        outs = llm.chat(chats[at : at + concurrency], params)
        tokens += [out.outputs[0].token_ids for out in outs]
        drafted += metric(llm, "flowllm:spec_decode_num_draft_tokens_total")
        accepted += metric(llm, "flowllm:spec_decode_num_accepted_tokens_total")
        tpot_sum += metric(llm, "flowllm:time_per_output_token_seconds_sum")
        tpot_count += metric(llm, "flowllm:time_per_output_token_seconds_count")
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    total = sum(map(len, tokens))
    return Run(
        mode=mode, concurrency=concurrency, pair=pair, seconds=round(seconds, 2),
        output_tokens=total, tokens_per_s=round(total / seconds, 1),
        tpot_ms=round(1000 * tpot_sum / max(tpot_count, 1), 1),
        cpu_ms_per_token=round(1000 * cpu / total, 1), drafted=drafted,
        accepted=accepted, load_average=round(os.getloadavg()[0], 2),
    ), tokens  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=BUNDLED_MODEL)
    parser.add_argument(
        "--prompts", type=int, default=4, help="prompts at concurrency 1 (0: none, skip it)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=32, help="the batch of the second run (0: skip it)"
    )
    parser.add_argument("--passage-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--draft",
        action="append",
        default=[],
        help="also run mode draft:NAME drafting with this model (a path or Hub id; repeatable)",
    )
    parser.add_argument(
        "--draft-quantization",
        default="auto",
        help="how each --draft loads its weights, comma-separated (speculative_config's "
        "quantization: auto, none, int8), a mode per draft and value",
    )
    parser.add_argument("--json", help="also write the runs here")
    args = parser.parse_args()

    spec = {"num_speculative_tokens": args.num_speculative_tokens}
    engines = {
        "none": LLM(args.model),
        "ngram": LLM(args.model, speculative_config={**spec, "disable_by_batch_size": None}),
        "adaptive": LLM(args.model, speculative_config=spec),
    }
    drafting: list[str] = []
    for draft in args.draft:
        for quantization in args.draft_quantization.split(","):
            config = {**spec, "model": draft, "disable_by_batch_size": None,
                      "quantization": quantization}  # fmt: skip
            suffix = "" if quantization == "auto" else f"-{quantization}"
            drafting.append(f"draft:{os.path.basename(draft.rstrip('/'))}{suffix}")
            engines[drafting[-1]] = LLM(args.model, speculative_config=config)
    count = max(args.prompts, args.concurrency)
    texts = passages(engines["none"].tokenizer, count, args.passage_tokens)
    chats = conversations(texts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in engines.values():  # warm up: kernels built, step plans recorded
        llm.chat(chats[:2], SamplingParams(temperature=0.0, max_tokens=16))
    sample = engines["none"].chat(chats[:1], params)[0].outputs[0].text
    print(f"an output (of {len(sample)} characters): {sample[:300]!r}", flush=True)
    default_threshold = SpeculativeConfig().disable_by_batch_size
    runs: list[Run] = []
    for pair in range(args.pairs):
        for concurrency, modes, prompts in (
            (1, ("none", "ngram", *drafting), chats[: args.prompts]),
            (
                args.concurrency,
                ("none", "ngram", "adaptive", *drafting),
                chats[: args.concurrency],
            ),
        ):
            if not prompts:  # --prompts 0 (--concurrency 0): concurrency N (1) only
                continue
            outputs: dict[str, list[list[int]]] = {}
            order = modes if pair % 2 == 0 else modes[::-1]
            for mode in order:
                result, outputs[mode] = run(engines[mode], mode, prompts, concurrency, pair, params)
                runs.append(result)
                print(json.dumps(asdict(result)), flush=True)
            if any(out != outputs["none"] for out in outputs.values()):
                raise SystemExit(
                    f"greedy outputs differ between modes at concurrency {concurrency}"
                )
    print(
        f"\nadaptive: disable_by_batch_size={default_threshold}; greedy outputs equal in every mode"
    )
    print("| concurrency | mode | pair | tok/s | ms per output token | CPU ms per token "
          "| accepted / drafted | load |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        rate = f"{r.accepted:.0f} / {r.drafted:.0f}" if r.drafted else "–"
        print(f"| {r.concurrency} | {r.mode} | {r.pair} | {r.tokens_per_s} | {r.tpot_ms} "
              f"| {r.cpu_ms_per_token} | {rate} "
              f"| {r.load_average} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in runs], f, indent=1)


if __name__ == "__main__":
    main()
