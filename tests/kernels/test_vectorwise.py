"""flowllm.kernels.vectorwise: every value of a CPU tensor takes torch's vector formula,
whatever the tensor's size, its split among threads or the rows beside it. The oracle runs
each 64 values as one call of exactly one vector step."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from flowllm.kernels.vectorwise import GRAIN, SPAN, vectorwise

# each function with the most values torch runs a call of it with on one thread
FUNCTIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
    "silu": (F.silu, GRAIN - 1),
    "gelu_tanh": (partial(F.gelu, approximate="tanh"), 6144),
}


def by_single_steps(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn of each SPAN values of x (zero-padded) in a call of its own."""
    flat = x.reshape(-1)
    padded = torch.zeros(-(-flat.numel() // SPAN) * SPAN, dtype=x.dtype)
    padded[: flat.numel()] = flat
    steps = [fn(padded[i : i + SPAN].clone()) for i in range(0, padded.numel(), SPAN)]
    return torch.cat(steps)[: flat.numel()].view(x.shape)


@pytest.mark.parametrize("name", list(FUNCTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_value_takes_the_vector_formula(name: str, dtype: torch.dtype) -> None:
    fn, serial_values = FUNCTIONS[name]
    generator = torch.Generator().manual_seed(5)
    # sizes below one span, within one piece, over several pieces of either size
    for shape in [(1, 37), (3, 48), (64, 64), (1, 4097), (7, 1000), (90, 80), (2, 40001)]:
        x = (4 * torch.randn(shape, generator=generator)).to(dtype)
        got = vectorwise(fn, x, serial_values)
        assert got.shape == x.shape and got.dtype == dtype
        assert torch.equal(got, by_single_steps(fn, x)), shape
        # a strided view gives the values of its contiguous copy
        wide = torch.cat((x, x), dim=-1)[:, : shape[1]]
        assert torch.equal(vectorwise(fn, wide, serial_values), got)


def test_a_row_is_the_same_among_any_rows() -> None:
    x = torch.randn(200, 48, generator=torch.Generator().manual_seed(6))
    full = vectorwise(F.silu, x)
    for start, rows in [(0, 1), (5, 1), (17, 2), (33, 7), (100, 100)]:
        assert torch.equal(vectorwise(F.silu, x[start : start + rows]), full[start : start + rows])


def test_empty_and_off_the_cpu_run_the_function_as_it_is() -> None:
    calls: list[torch.Size] = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        return F.silu(x)

    assert vectorwise(spy, torch.empty(0, 8)).shape == (0, 8)
    assert calls == [torch.Size([0, 8])]
    meta = torch.empty(3, 5, device="meta")
    assert vectorwise(spy, meta).shape == (3, 5)
    assert calls[-1] == torch.Size([3, 5])
