"""The linear products of one SmolLM2-135M step with its GGUF Q4_1 weights kept quantized
(every layer Q4_1, the tied LM head Q8_0, as the bundled file has them) beside the same
shapes in bf16 (`cpu_linear.PackedLinear`), at each row count: what a decode step of that
batch spends in products. Where the CPU has the bf16 product, the quantized products take
and give bf16 activations too, as a bf16 model's layers do; float32 elsewhere. Random
codes and scales; every product of the step runs in turn, so weights stream from memory as
in a real step.

    .venv/bin/python benchmarks/quant_step.py --threads 1 --cpu-time
    .venv/bin/python benchmarks/quant_step.py --threads 1 --cpu-time --rows 1,8,32 --no-bf16

Run it under two checkouts in turn (PYTHONPATH) to compare kernels side by side.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from linear_step import SHAPES, run_all  # benchmarks/ is on sys.path
from model_step import add_timing_options, best_times, timing_clock

from flowllm.kernels import cpu_linear
from flowllm.kernels.quant_linear import QuantizedLinear, QuantizedWeight

F32 = torch.float32


def q4_1(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """Random Q4_1-shaped weights: 4-bit codes, float16 scales and offsets per 32 values."""
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
    mins = (-8 * scales.float() * (0.9 + 0.2 * torch.rand(n, k // 32, generator=gen))).half()
    return QuantizedWeight(codes, scales, mins, "q4", 32, "Q4_1")


def q8_0(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.001).half()
    return QuantizedWeight(codes, scales, None, "q8", 32, "Q8_0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--no-bf16", action="store_true", help="time the quantized products only")
    add_timing_options(ap)
    args = ap.parse_args()
    clock = timing_clock(args)
    gen = torch.Generator().manual_seed(0)
    layer, layers, _, head = SHAPES["smollm2-135m"]
    shapes = layer * layers
    bf16 = cpu_linear.serves(torch.bfloat16)
    act = torch.bfloat16 if bf16 else torch.float32
    quant = [QuantizedLinear(q4_1(o, i, gen), out_dtype=act) for o, i in shapes]
    quant.append(QuantizedLinear(q8_0(*head, gen), out_dtype=F32))  # logits, as the model's
    bf16 = bf16 and not args.no_bf16
    packed = (
        [cpu_linear.PackedLinear(torch.randn(o, i).to(torch.bfloat16) * 0.02) for o, i in shapes]
        + [cpu_linear.PackedLinear(torch.randn(*head).to(torch.bfloat16) * 0.02, None, F32)]
        if bf16
        else []
    )
    ins = [i for _, i in shapes] + [head[1]]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {clock} time, {act}")
    print(f"{'rows':>5} {'quantized ms':>13} {'bf16 ms':>8} {'quantized/bf16':>15}")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(rows, i).to(act) for i in ins]
        fns = [partial(run_all, quant, xs)]
        if bf16:
            fns.append(partial(run_all, packed, xs))
        times = best_times(fns, args.repeats, clock)
        t_b = f"{times[1] * 1e3:8.2f} {times[0] / times[1]:15.2f}" if bf16 else ""
        print(f"{rows:>5} {times[0] * 1e3:13.2f} {t_b}", flush=True)


if __name__ == "__main__":
    main()
