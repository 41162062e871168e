"""The offline `LLM` in one process or two (`multiprocess=True`): output tok/s, alternately.

Both engines load the same model with the same settings; each round runs `generate` on
the same random prompts (exact lengths by the model's tokenizer, `flowllm.bench.prompts`),
greedy, `--output-len` tokens each with `ignore_eos`, in one engine and then the other
(the order alternates between rounds).

    .venv/bin/python benchmarks/offline_processes.py                     # the bundled model
    .venv/bin/python benchmarks/offline_processes.py --num-prompts 256 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from flowllm import LLM, SamplingParams
from flowllm.bench.prompts import random_prompts


def rate(llm: LLM, prompts: list[str], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a model path or name (default: the bundled one)")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    one = LLM(args.model, enable_prefix_caching=False)
    two = LLM(args.model, enable_prefix_caching=False, multiprocess=True)
    prompts = [
        p.text
        for p in random_prompts(
            args.num_prompts, args.input_len, args.output_len, seed=0, tokenizer=one.tokenizer
        )
    ]
    engines = {"one process": one, "multiprocess": two}
    for llm in engines.values():  # warm-up
        rate(llm, prompts[:8], 8)
    figures: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for round_ in range(args.rounds):
            order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
            for name in order:
                figures[name].append(rate(engines[name], prompts, args.output_len))
                print(f"round {round_ + 1} {name:12} {figures[name][-1]:8.1f} tok/s", flush=True)
    finally:
        two.close()
    print(f"\nload average {os.getloadavg()[0]:.1f}; medians:")
    for name, values in figures.items():
        print(f"  {name:12} {statistics.median(values):8.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
