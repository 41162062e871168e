"""Offline throughput: flowllm's `LLM.generate` beside transformers `generate`, same process.

Workload (vLLM's `benchmark_throughput` shape): random-token prompts of `--input-len`
tokens, `--output-len` generated tokens each, greedy, ignore_eos, `--num-requests`
requests submitted at once. Models: the GPT-2 124M shape (random weights, real
tokenizer) and the bundled SmolLM2-135M; dtypes float32 and bfloat16.

Baselines, on the same weights and prompts (`AutoModelForCausalLM.from_pretrained(dir,
dtype=...)`, `generate(do_sample=False, min_new_tokens=out, max_new_tokens=out)`):
- `one`: one request at a time. Timed on a sample of `--sample-requests` requests (the
  whole set would take hours); the rate is output tokens over the time of that sample.
- `static`: static batches of `--static-batch` (16; equal-length prompts, so no padding is
  needed), timed on `--sample-batches` batches (`static16` is the same name, kept).

`--device cuda` runs both engines on the GPU (`auto`: the GPU where there is one): the
transformers model is moved there, flowllm's KV cache takes `--gpu-memory-utilization` of
the device's memory, and the matmul rate is measured there.

Roofline: the workload's FLOPs (matmuls of every layer for each computed token, attention
over each token's context, the LM head for each sampled row) over the dtype's matmul
rate measured in this run (best of a 2048^3 product, timed just before and just after the
flowllm run, the higher kept: other work on a shared machine only lowers it).
`roofline%` = that floor over the measured time: 100% would mean the engine ran every
FLOP at the rate of a large matmul.

Greedy agreement: flowllm's tokens for the `one` sample compared with transformers' (same
dtype); random weights give flat logits, so near-ties may flip late tokens in bfloat16.

    .venv/bin/python benchmarks/throughput.py                      # full run (many minutes)
    .venv/bin/python benchmarks/throughput.py --num-requests 32 --input-len 32 \\
        --output-len 16 --models gpt2-124m --dtypes bfloat16 --baselines static16
    python benchmarks/throughput.py --device cuda --models gpt2-124m --dtypes bfloat16 \\
        --baselines one,static --static-batch 256 --sample-batches 1 --sample-requests 4
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_fixtures import build_gpt2_dir

from flowllm.config import BUNDLED_MODEL
from flowllm.llm import LLM
from flowllm.messages import SamplingParams
from flowllm.models.loader import resolve_model

MODELS = ("gpt2-124m", "smollm2-135m")
DTYPES = ("float32", "bfloat16")
BASELINES = ("one", "static")
BASELINE_ALIASES = {"static16": "static"}  # the name of earlier commands
STAGES = ("schedule", "execute", "sample", "detokenize", "deliver")


class BenchmarkError(RuntimeError):
    """The benchmark cannot run as asked (bad option, an engine that returned too little)."""


@dataclass
class Workload:
    """The requests every engine runs: the same prompts, lengths and greedy decoding."""

    prompts: list[list[int]]
    output_len: int

    @property
    def output_tokens(self) -> int:
        return len(self.prompts) * self.output_len


@dataclass
class Result:
    """One model x dtype: rates (output tokens/s) and what they are measured on."""

    model: str
    dtype: str
    num_requests: int
    input_len: int
    output_len: int
    matmul_gflops: float
    workload_tflop: float
    flowllm_s: float
    flowllm_tok_s: float
    roofline_pct: float
    stage_busy_s: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    one_tok_s: float | None = None
    one_sample: int = 0
    static_tok_s: float | None = None
    static_sample: int = 0
    static_batch: int = 16
    device: str = "cpu"
    greedy_match: str = ""

    def ratio(self, baseline: float | None) -> float | None:
        return None if not baseline else self.flowllm_tok_s / baseline


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of `repeats` runs after one warm-up (least disturbed)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def matmul_rate(dtype: torch.dtype, device: str = "cpu", repeats: int = 5) -> float:
    """FLOP/s of an n x n x n product in `dtype` on `device`, now: n = 2048 on a CPU, 8192
    on a GPU (a smaller product there times its launch, not its arithmetic)."""
    n = 8192 if device == "cuda" else 2048
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))

    def product() -> None:
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()

    return 2 * n**3 / best_time(product, repeats)


def linear_params(model: torch.nn.Module) -> tuple[int, int]:
    """(weights of the per-layer matmuls, weights of the LM head) of a transformers model.

    GPT-2 uses transformers' Conv1D ([in, out]) for its projections, Llama nn.Linear; both
    count as in * out multiply-adds per token. Embedding lookups cost no matmul.
    """
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    body = 0
    for module in model.modules():
        if module is head:
            continue
        if isinstance(module, torch.nn.Linear | Conv1D):
            body += module.weight.numel()
    if head is None:
        raise BenchmarkError("the model has no LM head")
    return body, head.weight.numel()


def workload_flops(model: torch.nn.Module, input_len: int, output_len: int, n: int) -> float:
    """FLOPs of `n` requests: prompt and every generated token but the last go through the
    layers (the last token is sampled, never fed back), attention over each token's context
    (QK^T and PV, 2 * 2 * ctx * q_width per layer), and the LM head for each sampled row."""
    body, head = linear_params(model)
    cfg = model.config
    layers = cfg.num_hidden_layers
    q_width = cfg.hidden_size  # num_heads * head_dim for both shapes
    fed = input_len + output_len - 1  # tokens each request computes through the layers
    contexts = fed * (fed + 1) // 2  # sum over positions p of (p + 1) attended keys
    per_request = 2 * body * fed + 4 * layers * q_width * contexts + 2 * head * output_len
    return float(per_request * n)


def model_dir(name: str, scratch: Path) -> Path:
    """An HF-format directory for `name`: the GPT-2 shape is written once into `scratch`."""
    if name == "gpt2-124m":
        dest = scratch / "gpt2-124m"
        if not (dest / "model.safetensors").exists():
            build_gpt2_dir(dest, seed=0)
        return dest
    if name == "smollm2-135m":
        return Path(resolve_model(BUNDLED_MODEL).path)
    raise BenchmarkError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def random_prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    """Uniform random token ids, keeping clear of the low ids where special tokens live."""
    g = torch.Generator().manual_seed(seed)
    low = min(1000, vocab_size // 4)
    ids = torch.randint(low, vocab_size - 1, (n, length), generator=g)
    return ids.tolist()


def kv_bytes_per_token(cfg: Any, dtype: torch.dtype) -> int:
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).itemsize


def run_flowllm(
    path: Path, dtype: str, work: Workload, args: argparse.Namespace, kv_memory: int
) -> tuple[float, list[list[int]], dict[str, float], int]:
    """(seconds, output ids per request, busy seconds per stage, model steps) of one run."""
    settings: dict[str, Any] = {
        "dtype": dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_memory": kv_memory,
        "max_model_len": len(work.prompts[0]) + work.output_len,
        "device": args.device,
    }
    if args.device == "cuda":  # the KV cache's share of the GPU (kv_cache_memory is the CPU's)
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.trace_dir is not None:  # record the runs (the timed one is the last written)
        settings["trace_dir"] = args.trace_dir / f"{path.name}-{dtype}"
        settings["trace_max_bytes"] = args.trace_max_bytes
    llm = LLM(str(path), graph=args.graph, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=work.output_len, ignore_eos=True)
    llm.generate(work.prompts[:4], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
    started = time.perf_counter()
    outputs = llm.generate(work.prompts, params)
    elapsed = time.perf_counter() - started
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    if any(len(t) != work.output_len for t in ids):
        raise BenchmarkError("flowllm returned fewer tokens than asked (ignore_eos is set)")
    registry = llm.last_run.registry if llm.last_run is not None else None
    busy: dict[str, float] = {}
    steps = 0
    if registry is not None:
        for stage in STAGES:
            value = registry.get_sample_value(
                "flowllm:stage_duration_seconds_sum", {"stage": stage}
            )
            busy[stage] = float(value or 0.0)
        count = registry.get_sample_value(
            "flowllm:stage_duration_seconds_count", {"stage": "execute"}
        )
        steps = int(count or 0)
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the KV cache's memory back for transformers' runs
    return elapsed, ids, busy, steps


def hf_generate(model: Any, prompts: Sequence[Sequence[int]], output_len: int) -> list[list[int]]:
    """Greedy generate for equal-length prompts in one batch; the new token ids per row."""
    input_ids = torch.tensor(prompts, dtype=torch.int64, device=model.device)  # [B, input_len]
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            min_new_tokens=output_len,
            max_new_tokens=output_len,
            pad_token_id=pad,
        )
    return out[:, input_ids.shape[1] :].tolist()


def run_transformers(
    model: Any, work: Workload, baseline: str, sample: int, static_batch: int
) -> tuple[float, int, list[list[int]]]:
    """(output tokens/s, requests timed, their outputs) of one baseline on a sample."""
    if baseline == "one":
        batch, count = 1, min(sample, len(work.prompts))
    else:
        batch = min(static_batch, len(work.prompts))
        count = min(sample * batch, len(work.prompts))
    hf_generate(model, work.prompts[:batch], 4)  # warm up
    outputs: list[list[int]] = []
    started = time.perf_counter()
    for i in range(0, count, batch):
        outputs.extend(hf_generate(model, work.prompts[i : i + batch], work.output_len))
    elapsed = time.perf_counter() - started
    return count * work.output_len / elapsed, count, outputs


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """'k/n identical, mean common prefix p tokens' over the compared requests."""
    same = sum(a == b for a, b in zip(ours, theirs, strict=False))
    prefixes = []
    for a, b in zip(ours, theirs, strict=False):
        common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        prefixes.append(min(len(a), len(b)) if common is None else common)
    mean = sum(prefixes) / len(prefixes) if prefixes else 0.0
    return f"{same}/{len(prefixes)} identical, mean common prefix {mean:.0f}"


def bench_one(
    name: str, dtype: str, scratch: Path, args: argparse.Namespace, rates: dict[str, float]
) -> Result:
    from transformers import AutoModelForCausalLM

    path = model_dir(name, scratch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype)).eval()
    hf = hf.to(args.device)
    cfg = hf.config
    work = Workload(
        random_prompts(cfg.vocab_size, args.num_requests, args.input_len, args.seed),
        args.output_len,
    )
    flops = workload_flops(hf, args.input_len, args.output_len, args.num_requests)
    seq_len = args.input_len + args.output_len
    kv_memory = args.kv_cache_memory or int(
        1.05
        * min(args.max_num_seqs, args.num_requests)
        * (seq_len + 16)
        * kv_bytes_per_token(cfg, torch_dtype(dtype))
    )  # room for every running sequence's whole length: no preemption

    before = matmul_rate(torch_dtype(dtype), args.device)
    elapsed, ours, busy, steps = run_flowllm(path, dtype, work, args, kv_memory)
    # The machine is shared: the best rate seen around the run is what it could do then.
    rate = rates[dtype] = max(before, matmul_rate(torch_dtype(dtype), args.device))
    result = Result(
        model=name,
        dtype=dtype,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        matmul_gflops=rate / 1e9,
        workload_tflop=flops / 1e12,
        flowllm_s=elapsed,
        flowllm_tok_s=work.output_tokens / elapsed,
        roofline_pct=100 * flops / rate / elapsed,
        stage_busy_s=busy,
        steps=steps,
        static_batch=args.static_batch,
        device=args.device,
    )
    print(
        f"  flowllm: {result.flowllm_tok_s:.0f} tok/s ({elapsed:.1f} s, {steps} steps, "
        f"{result.roofline_pct:.0f}% of roofline)",
        flush=True,
    )
    for baseline in args.baselines:
        sample = args.sample_requests if baseline == "one" else args.sample_batches
        tok_s, timed, theirs = run_transformers(hf, work, baseline, sample, args.static_batch)
        if baseline == "one":
            result.one_tok_s, result.one_sample = tok_s, timed
            result.greedy_match = agreement(ours[:timed], theirs)
        else:
            result.static_tok_s, result.static_sample = tok_s, timed
            if not result.greedy_match:
                result.greedy_match = agreement(ours[:timed], theirs)
        print(f"  transformers {baseline}: {tok_s:.1f} tok/s ({timed} requests)", flush=True)
    del hf
    gc.collect()
    return result


def fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def report(results: list[Result]) -> None:
    """The summary table (Markdown, so it pastes into benchmarks/README.md)."""
    print()
    static = results[0].static_batch if results else 16
    print(
        "| model | dtype | flowllm tok/s | roofline % | transformers one-at-a-time tok/s | "
        f"× one | transformers static {static} tok/s | × static |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.model} | {r.dtype} | {r.flowllm_tok_s:.0f} | {r.roofline_pct:.0f} | "
            f"{fmt(r.one_tok_s, '.1f')} | {fmt(r.ratio(r.one_tok_s), '.1f')} | "
            f"{fmt(r.static_tok_s, '.1f')} | {fmt(r.ratio(r.static_tok_s), '.1f')} |"
        )
    print()
    for r in results:
        busy = ", ".join(f"{k} {v:.1f}" for k, v in r.stage_busy_s.items())
        print(
            f"{r.model} {r.dtype}: {r.workload_tflop:.2f} TFLOP at {r.matmul_gflops:.0f} "
            f"GFLOP/s; {r.steps} steps in {r.flowllm_s:.1f} s; stage busy s: {busy}; "
            f"greedy vs transformers: {r.greedy_match or '—'}"
        )


def names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    chosen = [BASELINE_ALIASES.get(t.strip(), t.strip()) for t in text.split(",") if t.strip()]
    unknown = [c for c in chosen if c not in allowed]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{what}: choose from {', '.join(allowed)}")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--models", type=lambda t: names(t, MODELS, "--models"), default=MODELS)
    parser.add_argument("--dtypes", type=lambda t: names(t, DTYPES, "--dtypes"), default=DTYPES)
    parser.add_argument(
        "--baselines",
        type=lambda t: [] if t == "none" else names(t, BASELINES, "--baselines"),
        default=BASELINES,
        help="one,static or none",
    )
    parser.add_argument("--static-batch", type=int, default=16, help="the 'static' batch size")
    parser.add_argument("--sample-requests", type=int, default=8, help="timed for 'one'")
    parser.add_argument("--sample-batches", type=int, default=2, help="timed for 'static'")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="both engines' device (default: cuda where available, else cpu)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.5,
        help="on cuda, flowllm's KV cache share of the GPU (the rest is transformers')",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--kv-cache-memory", type=int, default=0, help="bytes (default: fits every sequence)"
    )
    parser.add_argument("--graph", help="a graph YAML instead of the default one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--trace-dir", type=Path, help="record flowllm's runs into DIR/<model>-<dtype>"
    )
    parser.add_argument("--trace-max-bytes", type=int, help="stop recording at this size")
    args = parser.parse_args()
    if min(args.num_requests, args.input_len, args.output_len, args.static_batch) < 1:
        parser.error("--num-requests, --input-len, --output-len, --static-batch must be >= 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"

    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {args.device} ({where}), torch threads {torch.get_num_threads()}", flush=True)
    rates = {dt: matmul_rate(torch_dtype(dt), args.device) for dt in args.dtypes}
    print(
        "matmul rate at start: "
        + ", ".join(f"{dt} {r / 1e9:.0f} GFLOP/s" for dt, r in rates.items()),
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            for dtype in args.dtypes:
                print(
                    f"{name} {dtype}: {args.num_requests} requests, {args.input_len} in / "
                    f"{args.output_len} out",
                    flush=True,
                )
                results.append(bench_one(name, dtype, Path(tmp), args, rates))
    report(results)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))


if __name__ == "__main__":
    main()
