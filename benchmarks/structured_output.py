"""Structured outputs under load: half the requests under a JSON schema vs none, same run.

Workload: `--concurrency` chat-style prompts submitted at once to the offline engine on
the bundled SmolLM2-135M, `--output-len` tokens each. Variant `plain`: every request
unconstrained (ignore_eos). Variant `half`: the same, but every other request is under a
JSON schema (an array of at least 50 objects with enums, integers and nested arrays of
strings; no `maxLength`, which makes xgrammar's fill ~10,000x slower in-string) that
cannot complete within `--output-len`, so both variants generate exactly the same number
of tokens and differ only in the grammar work. The variants alternate for `--rounds`
rounds in one process; the figure is the median output tok/s of each and their ratio.

Per-step mask cost, from the stage duration histograms of each run: the guide stage's
mean time per step (advancing the matchers and filling the bitmasks, in its own thread
while the model runs) and sample's mean time per step (which applies the masks) in
either variant. Overlap: one extra traced `half` run; for every step whose batch holds a
constrained sequence, whether guide's span ended before execute's did (the mask was
ready before the logits).

    .venv/bin/python benchmarks/structured_output.py                # 32 requests, 3 rounds
    .venv/bin/python benchmarks/structured_output.py --rounds 1 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from flowllm.llm import LLM
from flowllm.messages import SamplingParams, StructuredOutputs
from flowllm.traces.trace import load_trace

SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 50,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "kind": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["id", "kind", "tags"],
            },
        }
    },
    "required": ["records"],
}  # fmt: skip


def params(args: argparse.Namespace, constrained: bool) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.output_len,
        temperature=0.0,
        ignore_eos=not constrained,
        structured_outputs=StructuredOutputs(json=SCHEMA) if constrained else None,
    )


def run(llm: LLM, args: argparse.Namespace, half: bool) -> dict[str, Any]:
    prompts = [f"List the records of batch {i} as JSON:" for i in range(args.concurrency)]
    sampling = [params(args, half and i % 2 == 1) for i in range(args.concurrency)]
    started = time.perf_counter()
    outputs = llm.generate(prompts, sampling)
    elapsed = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    if tokens != args.concurrency * args.output_len:
        raise RuntimeError(f"expected {args.concurrency * args.output_len} tokens, got {tokens}")
    registry = llm.last_run.registry  # type: ignore[union-attr]

    def mean_ms(stage: str) -> float:
        labels = {"stage": stage}
        total = registry.get_sample_value("flowllm:stage_duration_seconds_sum", labels) or 0.0
        count = registry.get_sample_value("flowllm:stage_duration_seconds_count", labels) or 1.0
        return 1e3 * total / count

    return {
        "tok_s": tokens / elapsed,
        "guide_ms": mean_ms("guide"),
        "sample_ms": mean_ms("sample"),
        "execute_ms": mean_ms("execute"),
    }


def overlap(llm_args: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One traced `half` run: did each constrained step's mask beat its logits?"""
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(**llm_args, trace_dir=tmp, trace_channels=["guide.in", "sample.masks"])
        run(llm, args, half=True)
        trace = load_trace(Path(tmp))
        masked = {e.message.step_id for e in trace.entries["sample.masks"] if e.message.seq_ids}
        spans: dict[tuple[str, int], Any] = {}
        for span in trace.spans:
            if span.step_id is not None and span.stage in ("guide", "execute"):
                spans[span.stage, span.step_id] = span
    ahead = durations = 0
    guide_us: list[float] = []
    for step in masked:
        g, x = spans.get(("guide", step)), spans.get(("execute", step))
        if g is None or x is None:
            continue
        durations += 1
        guide_us.append(g.duration * 1e6)
        ahead += g.started + g.duration <= x.started + x.duration
    return {
        "constrained_steps": durations,
        "mask_ready_first": ahead,
        "guide_span_median_us": statistics.median(guide_us) if guide_us else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm_args = {"dtype": args.dtype, "max_num_seqs": max(32, args.concurrency)}
    llm = LLM(**llm_args)
    llm.generate(["warm up"], params(args, True))  # builds the tokenizer's grammar tables
    results: dict[str, list[dict[str, Any]]] = {"plain": [], "half": []}
    for _ in range(args.rounds):
        for name in ("plain", "half"):
            results[name].append(run(llm, args, half=name == "half"))
    report: dict[str, Any] = {"concurrency": args.concurrency, "output_len": args.output_len}
    for name, runs in results.items():
        report[name] = {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}
    report["ratio_half_over_plain"] = round(report["half"]["tok_s"] / report["plain"]["tok_s"], 3)
    report["overlap"] = overlap(llm_args, args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
