"""Graph overhead per step: the default graph with a model that answers instantly.

Everything but the model forward runs for real — ingest, validate, tokenize (GPT-2
tokenizer), the scheduler with its block pool, input building, the sampler (greedy), the
incremental detokenizer, format and the mailboxes — so the time per step is what the graph
adds around a model step. Run:

    .venv/bin/python benchmarks/pipeline_overhead.py [--vocab 50257] [--steps 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_fixtures import write_gpt2_tokenizer_files

from flowllm.config import engine_config
from flowllm.llm import LLM
from flowllm.messages import SamplingParams
from flowllm.models.tokenizer import load_tokenizer
from flowllm.stages.services import EngineServices


class InstantModel:
    """Returns the same logits row for every sampled position, at once.

    The rows are a view of one persistent tensor, not a fresh output as a real model's:
    fine for the greedy sampler here, which only reads them.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        generator = torch.Generator().manual_seed(0)
        self._row = torch.randn(vocab_size, generator=generator)
        self._logits = self._row.expand(1024, vocab_size).contiguous()

    def __call__(self, input_ids: Any, positions: Any, kv_caches: Any, ctx: Any) -> torch.Tensor:
        return self._logits[: len(ctx.logits_indices)]


def services(vocab_size: int, tokenizer: Any) -> EngineServices:
    config = engine_config(
        "instant", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192
    )
    return EngineServices(
        config=config,
        model=InstantModel(vocab_size),
        tokenizer=tokenizer,
        kv_caches=[],
        num_blocks=256 * 64,
        max_model_len=4096,
        eos_token_ids=(50256,),
        device=torch.device("cpu"),
    )


STAGES = ("schedule", "execute", "sample", "detokenize", "format")


def cpu_seconds() -> float:
    """User + system CPU time of this process (every thread) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(llm: LLM, num_seqs: int, steps: int) -> tuple[float, float, int, dict[str, float]]:
    """(seconds, CPU seconds, model steps, busy seconds per stage) of one generate."""
    prompts = [[(i * 7 + k) % 50000 for k in range(16)] for i in range(num_seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    cpu_started = cpu_seconds()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    cpu = cpu_seconds() - cpu_started
    assert all(len(o.outputs[0].token_ids) == steps for o in outputs)
    assert llm.last_run is not None
    registry = llm.last_run.registry
    count = registry.get_sample_value("flowllm:stage_duration_seconds_count", {"stage": "execute"})
    busy = {
        stage: float(
            registry.get_sample_value("flowllm:stage_duration_seconds_sum", {"stage": stage}) or 0
        )
        for stage in STAGES
    }
    return elapsed, cpu, int(count or 0), busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_gpt2_tokenizer_files(Path(tmp))
        tokenizer = load_tokenizer(tmp)
    llm = LLM(services=services(args.vocab, tokenizer))
    run(llm, 4, 4)  # warm up
    print(f"vocab {args.vocab}, {args.steps} decode steps per run, greedy, instant model")
    print("best of --repeats runs. A round: every running sequence gains one token (the")
    print("scheduler may split a round into several steps while requests trickle in); stage")
    print("columns: busy µs per round (execute and sample include waiting for the GIL in")
    print("their worker thread). The prompts' prefill step is spread over the rounds.")
    print("cpu µs/round: the process's CPU time (all threads), steadier than wall time on a")
    print("shared machine.")
    head = "".join(f"{s:>11}" for s in STAGES)
    print(
        f"{'running seqs':>12} {'steps':>6} {'µs/step':>9} {'rounds/s':>9} {'µs/round':>9} "
        f"{'cpu µs/round':>13} {'µs/seq-token':>13}{head}"
    )
    for num_seqs in (1, 64, 256):
        runs = [run(llm, num_seqs, args.steps) for _ in range(args.repeats)]
        elapsed, _, steps, busy = min(runs, key=lambda r: r[0])
        cpu = min(r[1] for r in runs)
        per_round = elapsed / args.steps
        stages = "".join(f"{busy[s] / args.steps * 1e6:>11.0f}" for s in STAGES)
        print(
            f"{num_seqs:>12} {steps:>6} {elapsed / steps * 1e6:>9.0f} {1 / per_round:>9.0f} "
            f"{per_round * 1e6:>9.0f} {cpu / args.steps * 1e6:>13.0f} "
            f"{per_round * 1e6 / num_seqs:>13.1f}{stages}"
        )


if __name__ == "__main__":
    main()
