"""The linear products of GPT-2 124M steps (fp32, oneDNN's packed layout, as where the
native kernels do not serve) whose row counts cycle through `k` values, with oneDNN's and
ideep's caches of compiled products bounded at each capacity in turn: what a bound
(`flowllm.models.onednn_caches`) costs in recompilation, and what the caches hold.

Each capacity runs in processes of its own (the caches read it at their first use),
alternated. Per `k`: the row counts are k values spread over 1..`--rows-max`; a cycle
through them untimed (every shape compiled once), then the best of `--repeats` cycles
(over every process of the capacity). `ms/step` is that cycle's time per step;
`heap MB` is what glibc's heap holds in use beyond the packed weights after each `k`
(cumulative: the `k` before it ran in the same process).

    .venv/bin/python benchmarks/onednn_cache.py --threads 1 --cpu-time
    .venv/bin/python benchmarks/onednn_cache.py --capacities 16,64,1024 --distinct 1,3,12
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from model_step import add_timing_options  # benchmarks/ is on sys.path

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import argparse, json, sys
    import torch
    from flowllm.models.glibc_heap import in_use
    from flowllm.models.layers import Linear
    from linear_step import SHAPES
    from model_step import best_time, timing_clock

    args = argparse.Namespace(**json.loads(sys.argv[1]))
    clock = timing_clock(args)
    layer, layers, biased, head = SHAPES["gpt2-124m"]
    linears = []
    for out, inp, bias in [(o, i, biased) for o, i in layer] * layers + [(*head, False)]:
        linear = Linear(inp, out, bias, torch.float32, torch.device("cpu"))
        with torch.no_grad():
            linear.weight.normal_(0, 0.02)
        linear.pack()
        assert linear.layout == "onednn", linear.layout
        linears.append(linear)

    def heap_mb():
        return in_use() / 2**20

    def cycle(counts):
        for rows in counts:
            x, wide = torch.randn(rows, 768), torch.randn(rows, 3072)
            for linear in linears:
                linear(x if linear.in_features == 768 else wide)

    results = []
    packed = heap_mb()
    with torch.no_grad():
        for k in args.distinct:
            counts = sorted({max(1, round(args.rows_max * (i + 1) / k)) for i in range(k)})
            seconds = best_time(lambda: cycle(counts), args.repeats, clock, warmup=1)
            results.append({"k": len(counts), "ms": seconds / len(counts) * 1e3,
                            "heap_mb": heap_mb() - packed})
    print(json.dumps(results))
    """
)


def run(capacity: int, args: argparse.Namespace) -> list[dict[str, float]]:
    env = {**os.environ, "FLOWLLM_NATIVE_KERNELS": "0",
           "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(capacity), "LRU_CACHE_CAPACITY": str(capacity),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks")])}  # fmt: skip
    config = json.dumps(vars(args))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, config], env=env, capture_output=True, text=True, check=True
    ).stdout
    results: list[dict[str, float]] = json.loads(out.splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--capacities", type=ints, default=[16, 1024])
    parser.add_argument("--distinct", type=ints, default=[1, 3, 6, 16])
    parser.add_argument("--rows-max", type=int, default=16)
    parser.add_argument("--processes", type=int, default=2, help="per capacity, alternated")
    add_timing_options(parser)
    args = parser.parse_args()
    runs: dict[int, list[list[dict[str, float]]]] = {c: [] for c in args.capacities}
    for _ in range(args.processes):
        for capacity in args.capacities:
            runs[capacity].append(run(capacity, args))
    print(f"{'capacity':>8} {'k':>3} {'ms/step':>9} {'heap MB':>8}")
    for capacity, results in runs.items():
        for i, first in enumerate(results[0]):
            ms = min(r[i]["ms"] for r in results)
            heap = max(r[i]["heap_mb"] for r in results)
            print(f"{capacity:>8} {int(first['k']):>3} {ms:>9.2f} {heap:>8.1f}")


if __name__ == "__main__":
    main()
