"""Offline throughput of a mixture-of-experts model beside dense models of the same active
and the same total parameter count: whether a step costs what its active parameters cost.

Three random checkpoints of one shape (GPT-2's tokenizer and vocabulary, tied
embeddings), saved by transformers and served by flowllm's `LLM`:
- `moe`: Qwen3-MoE, every layer `--experts` experts of width `--expert-width`, top
  `--top-k` (renormalized);
- `dense-active`: Qwen3 whose MLP is `--top-k` experts wide: the parameters a MoE token
  uses, but for the router's `experts x hidden` a layer;
- `dense-total`: Qwen3 whose MLP is all the experts wide: the MoE's parameters.

For each number of concurrent requests C, every model runs C random prompts of
`--input-len` tokens, `--output-len` greedy tokens each (ignore_eos), `--rounds` times in
turn (so that other work on a shared machine slows all alike); the best round's output
tokens per second is reported, with the load average before and after. Then one decode
step of each model (batches `--step-batches`, a context of 64) is timed in CPU time on one
torch thread, best of `--rounds` * 5 in turn, which other work on the machine disturbs
far less than wall time (the decode step of model_step.py).

    .venv/bin/python benchmarks/moe_throughput.py
    .venv/bin/python benchmarks/moe_throughput.py --concurrency 1,8 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_fixtures import GPT2_EOS_ID, GPT2_VOCAB_SIZE, write_gpt2_tokenizer_files
from model_step import BLOCK, best_times, step_seqs

from flowllm.llm import LLM
from flowllm.messages import SamplingParams
from flowllm.models.kv_cache import KVCacheSpec
from flowllm.models.loader import load_model
from flowllm.models.runner import ModelRunner

MODELS = ("moe", "dense-active", "dense-total")


def build(dest: Path, kind: str, args: argparse.Namespace) -> dict[str, int]:
    """Save the random checkpoint `kind` to `dest`; its (total, active per token) linear
    parameters, embeddings apart."""
    import transformers

    d, layers, width = args.hidden, args.layers, args.expert_width
    kw: dict[str, Any] = dict(
        num_hidden_layers=layers, hidden_size=d, num_attention_heads=d // 64,
        num_key_value_heads=max(1, d // 256), head_dim=64, vocab_size=GPT2_VOCAB_SIZE,
        max_position_embeddings=4096, bos_token_id=GPT2_EOS_ID, eos_token_id=GPT2_EOS_ID,
        tie_word_embeddings=True, initializer_range=0.05,
    )  # fmt: skip
    if kind == "moe":
        config: Any = transformers.Qwen3MoeConfig(
            **kw, intermediate_size=width, moe_intermediate_size=width,
            num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        )  # fmt: skip
        model: Any = transformers.Qwen3MoeForCausalLM(config)
    else:
        experts = args.top_k if kind == "dense-active" else args.experts
        config = transformers.Qwen3Config(**kw, intermediate_size=experts * width)
        model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(dest)
    write_gpt2_tokenizer_files(dest)
    heads, kv = kw["num_attention_heads"], kw["num_key_value_heads"]
    attention = d * 64 * (2 * heads + 2 * kv)
    mlp = 3 * d * width
    if kind == "moe":
        total = layers * (attention + args.experts * (mlp + d))
        active = layers * (attention + args.top_k * mlp + args.experts * d)
    else:
        total = active = layers * (attention + experts * mlp)
    return {"total": total, "active": active}


def run(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens per second of one generate over `prompts`."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return len(prompts) * output_len / elapsed


def step_times(paths: dict[str, Path], args: argparse.Namespace) -> dict[tuple[str, int], float]:
    """CPU seconds of one decode step of each model (context 64) at each batch, one thread."""
    torch.set_num_threads(1)
    batches = [int(b) for b in args.step_batches.split(",")]
    steps = {}
    for kind, path in paths.items():
        model = load_model(str(path), dtype=args.dtype, device="cpu").model
        kv = KVCacheSpec.for_model(model, BLOCK).allocate(max(batches) * 4, "cpu")
        runner = ModelRunner(model, kv, BLOCK, "cpu")
        for b in batches:
            steps[kind, b] = functools.partial(runner.run, step_seqs(b, 1, 64))
    times = best_times(list(steps.values()), args.rounds * 5, "cpu")
    return dict(zip(steps, times, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-width", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step-batches", default="1,8")
    args = ap.parse_args()
    step_batches = [int(b) for b in args.step_batches.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    rng = random.Random(0)
    print(f"load average before: {os.getloadavg()}", flush=True)
    rates: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="flowllm-moe-bench-") as tmp:
        sizes, engines = {}, {}
        for kind in MODELS:
            torch.manual_seed(0)
            sizes[kind] = build(Path(tmp) / kind, kind, args)
            engines[kind] = LLM(
                str(Path(tmp) / kind), dtype=args.dtype, max_num_seqs=max(levels),
                max_model_len=args.input_len + args.output_len, kv_cache_memory=2**30,
            )  # fmt: skip
            engines[kind].generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
            gc.collect()
        for c in levels:
            prompts = [
                [rng.randrange(GPT2_VOCAB_SIZE - 1) for _ in range(args.input_len)]
                for _ in range(c)
            ]
            for _ in range(args.rounds):
                for kind in MODELS:
                    rate = run(engines[kind], prompts, args.output_len)
                    rates[kind, c] = max(rates.get((kind, c), 0.0), rate)
        engines.clear()
        gc.collect()
        steps = step_times({kind: Path(tmp) / kind for kind in MODELS}, args)
    print(f"load average after: {os.getloadavg()}")
    print(
        f"\nshape: hidden {args.hidden}, {args.layers} layers, {args.experts} experts of "
        f"width {args.expert_width}, top {args.top_k}; {args.dtype}; prompts of "
        f"{args.input_len}, {args.output_len} output tokens; best of {args.rounds}; the tied "
        f"LM head ({GPT2_VOCAB_SIZE * args.hidden / 1e6:.1f}M) in every model besides\n"
    )
    print("| model | linear params, total | active per token | "
          + " | ".join(f"C={c} tok/s" for c in levels) + " | "
          + " | ".join(f"step b={b}, 1 thread, CPU ms" for b in step_batches) + " |")  # fmt: skip
    print("|---|---:|---:|" + "---:|" * (len(levels) + len(step_batches)))
    for kind in MODELS:
        s = sizes[kind]
        cells = " | ".join(f"{rates[kind, c]:.1f}" for c in levels)
        cells += " | " + " | ".join(f"{steps[kind, b] * 1e3:.1f}" for b in step_batches)
        print(f"| {kind} | {s['total'] / 1e6:.1f}M | {s['active'] / 1e6:.1f}M | {cells} |")


if __name__ == "__main__":
    main()
