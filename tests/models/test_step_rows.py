"""The row counts an encoder pads its steps to: at every one of them oneDNN's products give
rows other than the measured ones the outputs those rows have in a full step, bit for bit,
in bf16 at bge-small's shapes (where oneDNN splits the 1536-input product's sums by the row
count) and in float32."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from flowllm.models.layers import Linear, onednn_packs
from flowllm.models.step_rows import StepRows, candidate_counts, pad_rows

CPU = torch.device("cpu")
BGE_SMALL = [(384, 1152), (384, 384), (384, 1536), (1536, 384)]  # QKV, out, up, down
MAX_ROWS = 1024


def packed(shape: tuple[int, int], dtype: torch.dtype, layout: str) -> Linear:
    lin = Linear(*shape, True, dtype, CPU, layout=layout)  # type: ignore[arg-type]
    with torch.no_grad():
        assert lin.weight is not None and lin.bias is not None
        lin.weight.normal_(0, shape[0] ** -0.5)
        lin.bias.normal_()
    lin.pack()
    return lin


def test_candidates_end_at_the_largest_step() -> None:
    assert candidate_counts(1) == [1]
    assert candidate_counts(40) == [32, 40]
    counts = candidate_counts(2048)
    assert counts[:3] == [32, 64, 96] and counts[-3:] == [1536, 1792, 2048]
    assert all(b - a <= a // 4 for a, b in pairwise(counts[counts.index(1024) :]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_padded_steps_give_rows_their_full_step_outputs(dtype: torch.dtype) -> None:
    if not onednn_packs(dtype, CPU):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    linears = [packed(shape, dtype, "onednn") for shape in BGE_SMALL]
    steps = StepRows(linears, MAX_ROWS)
    counts = steps.counts()
    assert counts[-1] == MAX_ROWS
    generator = torch.Generator().manual_seed(7)  # rows other than the measured ones
    for lin in linears:
        x = torch.randn(MAX_ROWS, lin.in_features, generator=generator).to(dtype)
        full = lin(x)
        for rows in (1, 2, 31, 33, 100, 383, 385, 700, MAX_ROWS - 1):
            step = steps.padded(rows)
            assert step in counts and step >= rows
            start = MAX_ROWS - rows  # the step's rows sit elsewhere in the full one
            got = lin(pad_rows(x[start:], step))[:rows]
            assert torch.equal(got, full[start:]), (lin.in_features, lin.out_features, rows)


def test_products_not_onednns_are_not_padded() -> None:
    steps = StepRows([packed((64, 64), torch.float32, "plain")], 512)
    assert [steps.padded(n) for n in (1, 33, 512)] == [1, 33, 512]
    with pytest.raises(ValueError, match="over the 512"):
        steps.padded(513)


def test_pad_rows_appends_zero_rows() -> None:
    x = torch.ones(3, 4)
    assert pad_rows(x, 3) is x
    padded = pad_rows(x, 5)
    assert torch.equal(padded[:3], x) and not padded[3:].any()
