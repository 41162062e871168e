"""The linear layers of one model step, oneDNN (packed weights) beside the native kernel
(`flowllm.kernels.cpu_linear`), at each row count: where `Linear` switches between them.

Every product of one step runs in turn, layer by layer and the LM head last, so weights
stream from memory as in a real step (a model's weights do not fit the caches). Shapes:
GPT-2 124M and SmolLM2-135M, random weights, float32 and bfloat16, and an encoder's,
bge-small's (no LM head: its steps are whole prompts, hundreds to thousands of rows).
`GB/s` is weight bytes over time; `native/oneDNN` below 1 means the native kernel is
faster.

    .venv/bin/python benchmarks/linear_step.py --threads 1 --cpu-time
    .venv/bin/python benchmarks/linear_step.py --threads 2 --rows 1,8,64
    .venv/bin/python benchmarks/linear_step.py --models bge-small --rows 128,512,2048
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
from model_step import add_timing_options, best_times, timing_clock  # benchmarks/ is on sys.path

from flowllm.kernels import cpu_linear

# (out, in) of each layer's products, layers, whether they have biases, the LM head's
# (vocab, dim) if any
SHAPES: dict[str, tuple[list[tuple[int, int]], int, bool, tuple[int, int] | None]] = {
    "gpt2-124m": ([(2304, 768), (768, 768), (3072, 768), (768, 3072)], 12, True, (50257, 768)),
    "smollm2-135m": (
        [(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, False, (49152, 576)
    ),
    "bge-small": ([(1152, 384), (384, 384), (1536, 384), (384, 1536)], 12, True, None),
}  # fmt: skip

Product = Callable[[torch.Tensor], torch.Tensor]


def step_products(name: str, dtype: torch.dtype) -> tuple[list[Product], list[Product], int]:
    """(oneDNN products, native products, weight bytes) of one step of model `name`."""
    layer, layers, biased, head = SHAPES[name]
    shapes = [(o, i, biased) for o, i in layer] * layers + ([(*head, False)] if head else [])
    onednn: list[Product] = []
    ours: list[Product] = []
    for out, inp, has_bias in shapes:
        w = (torch.randn(out, inp) * 0.02).to(dtype)
        b = torch.randn(out).to(dtype) if has_bias else None
        dnn = torch.ops.mkldnn._reorder_linear_weight(w)
        packed = cpu_linear.PackedLinear(w, b)
        onednn.append(
            lambda x, w=dnn, b=b: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        )
        ours.append(packed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return onednn, ours, sum(o * i for o, i, _ in shapes) * itemsize


def run_all(products: list[Product], inputs: list[torch.Tensor]) -> None:
    for fn, x in zip(products, inputs, strict=True):
        fn(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,512")
    add_timing_options(ap)
    args = ap.parse_args()
    clock = timing_clock(args)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {clock} time")
    header = f"{'model':<13} {'dtype':<8} {'rows':>5} {'oneDNN ms':>10} {'GB/s':>6} "
    header += f"{'native ms':>10} {'GB/s':>6} {'native/oneDNN':>14}"
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
            if not cpu_linear.serves(dtype):
                print(f"{name:<13} {str(dtype)[6:]:<8} (no native kernel for this dtype here)")
                continue
            onednn, ours, nbytes = step_products(name, dtype)
            layer, layers, _, head = SHAPES[name]
            ins = [i for _, i in layer * layers] + ([head[1]] if head else [])
            for rows in [int(r) for r in args.rows.split(",")]:
                xs = [torch.randn(rows, i).to(dtype) for i in ins]
                t_dnn, t_ours = best_times(
                    [partial(run_all, onednn, xs), partial(run_all, ours, xs)], args.repeats, clock
                )
                print(
                    f"{name:<13} {str(dtype)[6:]:<8} {rows:>5} {t_dnn * 1e3:10.2f} "
                    f"{nbytes / t_dnn / 1e9:6.1f} {t_ours * 1e3:10.2f} "
                    f"{nbytes / t_ours / 1e9:6.1f} {t_ours / t_dnn:14.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
