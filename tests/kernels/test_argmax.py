"""Greedy argmax along logit rows against torch.argmax: the native kernel and the blocked
torch fallback, on ties, NaN, infinities, ragged tails and strided rows."""

from __future__ import annotations

import pytest
import torch

from flowllm.kernels import argmax

needs_native = pytest.mark.usefixtures("native_build")  # each build in turn


def hard_rows(rows: int, vocab: int) -> torch.Tensor:
    """Many ties, a -inf row, NaN early and last, maxima in the tail, +inf, a zero row."""
    gen = torch.Generator().manual_seed(14)
    x = torch.randint(0, 4, (rows, vocab), generator=gen).float()
    x[1] = float("-inf")
    x[2, [min(700, vocab - 3), vocab - 2]] = float("nan")
    x[3, -1] = float("nan")
    x[4, -1] = 9.0
    x[5, [vocab // 4, vocab // 4 + 1]] = 9.0
    x[6, vocab - 2 :] = 9.0
    x[7, min(5, vocab - 1)] = float("inf")
    x[8] = 0.0
    x[9, 0] = float("nan")
    x[10:20] = torch.randn(10, vocab, generator=gen)
    x[20:] = torch.randn(rows - 20, vocab, generator=gen) * 1e-3  # close values
    return x


VOCABS = [3, 16, 17, 1024, 1000 + 24 + 63, 4096 + 81, 50257]


@needs_native
@pytest.mark.parametrize("vocab", VOCABS)
def test_native_argmax_equals_torch_argmax(vocab: int) -> None:
    x = hard_rows(48, vocab)
    assert torch.equal(argmax.argmax_rows(x), x.argmax(dim=1))
    wide = torch.cat([x, torch.full((48, 5), 100.0)], dim=1)[:, :vocab]  # row stride > vocab
    assert wide.stride(0) == vocab + 5
    assert torch.equal(argmax.argmax_rows(wide), x.argmax(dim=1))
    assert torch.equal(argmax.argmax_rows(x[:0]), x[:0].argmax(dim=1))


@needs_native
def test_a_maximum_tied_across_the_kernels_lanes_and_chains_answers_its_first_index() -> None:
    """The kernel keeps several running maxima over interleaved vectors and merges them:
    a tie between them is decided by index, not by which one holds it."""
    x = torch.zeros(6, 1024)
    for row, at in enumerate([(17, 64), (64, 17 + 1024 - 64), (3, 131, 515), (1000, 1023)]):
        x[row, list(at)] = 9.0
    x[4, 8::8] = 9.0  # the first lane of every vector but the first, on both builds
    x[5] = float("-inf")
    x[5, 999] = -1.0
    assert torch.equal(argmax.argmax_rows(x), torch.tensor([17, 64, 3, 1000, 8, 999]))


@needs_native
def test_native_argmax_over_threads_equals_torch_argmax() -> None:
    x = torch.randn(300, 50257, generator=torch.Generator().manual_seed(3))  # > 1M: parallel
    x[::7, 123] = 50.0
    assert torch.equal(argmax.argmax_rows(x), x.argmax(dim=1))


@pytest.mark.parametrize("vocab", [1024, 1000 + 24 + 63, 4096 + 81, 50257])
def test_blocked_argmax_equals_torch_argmax(vocab: int) -> None:
    x = hard_rows(48, vocab)  # 48 rows: at least BLOCKED_FROM logits, so the blocks are used
    assert x.numel() >= argmax.BLOCKED_FROM
    assert torch.equal(argmax.blocked_argmax_rows(x), x.argmax(dim=1))
    assert torch.equal(argmax.blocked_argmax_rows(x[:0]), x[:0].argmax(dim=1))


def test_non_float32_rows_take_torch_argmax() -> None:
    x = hard_rows(24, 300).to(torch.bfloat16)
    assert torch.equal(argmax.argmax_rows(x), x.argmax(dim=1))
