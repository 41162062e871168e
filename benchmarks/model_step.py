"""Forward time of one model step (runner + model) on CPU, beside the floors set by the
bytes it must read and the FLOPs it must do, both measured on this machine in this run.

Decode steps run batch 1/8/32/64 at context 128 and 512 (each sequence attends over its
whole context); a prefill step runs one 512-token prompt. Shapes: GPT-2 124M and
SmolLM2-135M, random weights, float32 and bfloat16.

Floors: memory = (weight bytes + KV bytes read) / copy rate; compute = FLOPs / matmul rate
(the dtype's, at a large square shape). `floor/time` is the fraction of the floor
reached: 100% would be the machine's limit. The copy rate is measured anew for every row,
its copies alternating with the row's steps, so that other work slowing memory down
during the run slows both alike (the `copy` column).

    .venv/bin/python benchmarks/model_step.py                 # everything
    .venv/bin/python benchmarks/model_step.py --models gpt2-124m --dtypes float32 --batches 1

On a machine shared with other work, wall time measures the other work too; `--threads 1
--cpu-time` times this process's CPU time instead (rates and steps alike), which stays
meaningful under load because a single thread never waits for a descheduled sibling.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from flowllm.messages import ScheduledRows, ScheduledSeq
from flowllm.models.kv_cache import KVCacheSpec
from flowllm.models.layers import Embedding, Linear, pack_linears
from flowllm.models.registry import model_class_for
from flowllm.models.runner import ModelRunner

BLOCK = 16

MODELS: dict[str, dict[str, Any]] = {
    "gpt2-124m": {
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257,
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
}  # fmt: skip


CLOCK: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def add_timing_options(ap: argparse.ArgumentParser) -> None:
    """--repeats, --threads and --cpu-time, as the step benchmarks take them."""
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--cpu-time", action="store_true", help="time CPU, not wall, seconds")


def timing_clock(args: argparse.Namespace) -> str:
    """Apply --threads; the clock --cpu-time asks for."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return "cpu" if args.cpu_time else "wall"


def best_time(
    fn: Callable[[], object], repeats: int, clock: str = "wall", warmup: int = 2
) -> float:
    """The fastest of `repeats` runs (seconds): the least disturbed by other processes."""
    now = CLOCK[clock]
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeats):
        t = now()
        fn()
        best = min(best, now() - t)
    return best


def best_times(
    fns: Sequence[Callable[[], object]], repeats: int, clock: str = "wall", warmup: int = 2
) -> list[float]:
    """The fastest of `repeats` runs of each of `fns`, run in turn: a change of load on a
    shared machine during the measurement hits all of them alike."""
    now = CLOCK[clock]
    for fn in fns:
        for _ in range(warmup):
            fn()
    best = [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = now()
            fn()
            best[i] = min(best[i], now() - t)
    return best


class Copy:
    """A 256 MiB copy whose best time gives the memory rate (reads and writes counted)."""

    def __init__(self) -> None:
        self.src = torch.ones(64 * 1024 * 1024, dtype=torch.float32)
        self.dst = torch.empty_like(self.src)
        self.bytes = 2 * self.src.numel() * self.src.element_size()

    def __call__(self) -> None:
        self.dst.copy_(self.src)


def matmul_rate(dtype: torch.dtype, repeats: int, clock: str) -> float:
    """FLOP/s of a 1024 x 1024 x 1024 product in `dtype`: the faster of `F.linear` and the
    models' own linear layer (oneDNN with a packed weight, where MKL is slow on some CPUs)."""
    n = 1024
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    layer = Linear(n, n, False, dtype, torch.device("cpu"))
    layer.load_weight("w", b)
    layer.pack()
    t = min(
        best_time(lambda: F.linear(a, b), repeats, clock),
        best_time(lambda: layer(a), repeats, clock),
    )
    return 2 * n**3 / t


def build(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model with random weights, packed as loading a checkpoint leaves it."""
    config = MODELS[name]
    model = model_class_for(config)(config, dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "ln_" in pname:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    pack_linears(model)
    return model


def weight_stats(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes read per step, parameters in matmuls): every linear weight and every other
    parameter except embedding tables and GPT-2's position table (only the step's rows of
    those are gathered)."""
    read, matmul = 0, 0
    skip = {id(m.weight) for m in model.modules() if isinstance(m, Embedding)}
    for pname, p in model.named_parameters():
        if pname != "wpe" and id(p) not in skip:
            read += p.numel() * p.element_size()
    for m in model.modules():
        if isinstance(m, Linear):
            read += m.weight_bytes
            matmul += m.in_features * m.out_features
    return read, matmul


def attention_work(model: Any, q_lens: list[int], ctx_lens: list[int]) -> tuple[int, int]:
    """(KV bytes read, attention FLOPs) of one step."""
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * itemsize
    kv_bytes = sum(ctx_lens) * per_token
    flops = 0
    for q, c in zip(q_lens, ctx_lens, strict=True):
        visible = q * c - q * (q - 1) // 2  # causal pairs with a cached prefix of c - q
        flops += 4 * visible * model.num_layers * model.num_heads * model.head_dim
    return kv_bytes, flops


def step_seqs(batch: int, q_len: int, ctx: int) -> ScheduledRows:
    blocks_per_seq = -(-ctx // BLOCK)
    return ScheduledRows.of(
        ScheduledSeq(
            seq_id=i,
            token_ids=tuple((7 * i + j) % 1000 for j in range(q_len)),
            num_computed_tokens=ctx - q_len,
            block_table=tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            sample=True,
            num_output_tokens=0,
        )
        for i in range(batch)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="128,512")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument(
        "--enforce-eager", action="store_true", help="never replay recorded decode steps"
    )
    add_timing_options(ap)
    args = ap.parse_args()
    clock = timing_clock(args)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]

    copy = Copy()
    (copy_time,) = best_times([copy], args.repeats, clock)
    rates = {dt: matmul_rate(dt, args.repeats, clock) for dt in dtypes}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {clock} time")
    print(f"copy rate {copy.bytes / copy_time / 1e9:.1f} GB/s (read + write); matmul rate", end="")
    print(", ".join(f" {str(dt)[6:]} {r / 1e9:.0f} GFLOP/s" for dt, r in rates.items()))
    header = (
        f"{'model':<13} {'dtype':<8} {'step':<18} {'ms':>8} {'tok/s':>8} {'copy':>8} "
        f"{'mem floor':>9} {'flop floor':>10} {'floor/time':>10}"
    )
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        for dt in dtypes:
            model = build(name, dt)
            w_bytes, w_params = weight_stats(model)
            cases = [(f"decode b={b} ctx={c}", b, 1, c) for c in contexts for b in batches]
            if args.prefill:
                cases.append((f"prefill {args.prefill}", 1, args.prefill, args.prefill))
            max_blocks = max(b * -(-c // BLOCK) for _, b, _, c in cases)
            kv = KVCacheSpec.for_model(model, BLOCK).allocate(max_blocks, "cpu")
            for k, v in kv:  # realistic (non-zero) cache contents
                k.normal_()
                v.normal_()
            runner = ModelRunner(model, kv, BLOCK, "cpu", enforce_eager=args.enforce_eager)
            for label, batch, q_len, ctx in cases:
                seqs = step_seqs(batch, q_len, ctx)
                step = lambda s=seqs, r=runner: r.run(s)  # noqa: E731
                t, copy_time = best_times([step, copy], args.repeats, clock)
                rate = copy.bytes / copy_time
                kv_bytes, attn_flops = attention_work(model, [q_len] * batch, [ctx] * batch)
                mem = (w_bytes + kv_bytes) / rate
                comp = (2 * w_params * batch * q_len + attn_flops) / rates[dt]
                floor = max(mem, comp)
                print(
                    f"{name:<13} {str(dt)[6:]:<8} {label:<18} {t * 1e3:8.1f} "
                    f"{batch * q_len / t:8.0f} {rate / 1e9:5.1f}G/s {mem * 1e3:8.1f}m "
                    f"{comp * 1e3:9.1f}m "
                    f"{floor / t:9.0%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
