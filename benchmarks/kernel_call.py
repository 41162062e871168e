"""What one native kernel call costs from Python, through the functions the layers call
(`fused`, `argmax`, `cpu_linear`, `cpu_attention`), on inputs so small that the kernel's
own work is a small part: the fixed cost an eager step pays per kernel, ~300 times a
SmolLM2 step. Run it from two checkouts in turn to compare their calling paths:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kernel_call.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from flowllm.kernels import argmax, cpu_attention, cpu_linear, fused, native


def calls() -> dict[str, Callable[[], object]]:
    """Each kernel's call on a one-row input, as a decode step at batch 1 makes it."""
    x, res, w = torch.randn(1, 64), torch.randn(1, 64), torch.rand(64) + 0.5
    gate_up = torch.randn(1, 128)
    table = torch.randn(16, 2, 64)
    positions = torch.zeros(1, dtype=torch.int64)
    rows = torch.randn(1, 64)
    lin = cpu_linear.PackedLinear(torch.randn(64, 64))
    k_cache, v_cache = torch.randn(4, 16, 1, 64), torch.randn(4, 16, 1, 64)
    q, out = torch.randn(1, 1, 64), torch.empty(1, 1, 64)
    tables = torch.zeros(1, 4, dtype=torch.int32)
    lens = torch.full((1,), 16, dtype=torch.int32)
    slots = torch.zeros(1, dtype=torch.int64)
    kv = torch.randn(1, 1, 64)
    return {
        "rms_norm + residual": lambda: fused.rms_norm(x, w, 1e-5, res),
        "rope (in place)": lambda: fused.rope_(rows, 1, 64, table, positions),
        "silu_mul": lambda: fused.silu_mul(gate_up),
        "argmax_rows": lambda: argmax.argmax_rows(x),
        "linear 64x64": lambda: lin(x),
        "store_kv": lambda: cpu_attention.store_kv(kv, kv, k_cache, v_cache, slots),
        "decode_attention": lambda: cpu_attention.decode_attention(
            q, k_cache, v_cache, tables, lens, 0.125, out
        ),
    }


def best_us(fn: Callable[[], object], n: int, repeats: int) -> float:
    """The best of `repeats` mean times of `n` calls, in microseconds."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - started) / n)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if native.library() is None:
        raise SystemExit(native.status().describe())
    print(native.status().describe())
    for name, fn in calls().items():
        fn()
        print(f"{name:22s} {best_us(fn, args.calls, args.repeats):7.2f} µs")


if __name__ == "__main__":
    main()
