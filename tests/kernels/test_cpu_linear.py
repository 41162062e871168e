"""The native linear kernel (`flowllm.kernels.cpu_linear`) against a float64 product, on
shapes that exercise its edges: a partial last block of outputs, odd inner sizes, every row
count up to a full row group and past it; and the wrapper's argument checks."""

from __future__ import annotations

import pytest
import torch

from flowllm.kernels import cpu_linear
from flowllm.kernels.cpu_linear import NativeLinearError, PackedLinear
from flowllm.models.layers import Linear, pack_linears

DTYPES = [torch.float32, torch.bfloat16]
# each build in turn (bf16 products only where it has them: AVX-512 with AVX512-BF16)
each_build = pytest.mark.usefixtures("native_build")


def _needs(dtype: torch.dtype) -> None:
    if not cpu_linear.serves(dtype):
        pytest.skip(f"no native {dtype} product in this build on this CPU")


def _product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b in float64, rounded to x's dtype as the kernel rounds its output."""
    y = x.double() @ w.double().T
    if b is not None:
        y += b.double()
    return y


@each_build
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("n", "k"), [(37, 19), (16, 64), (100, 258), (5, 1)])
def test_matches_float64(dtype: torch.dtype, bias: bool, n: int, k: int) -> None:
    _needs(dtype)
    torch.manual_seed(n * k)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    layer = PackedLinear(w, b)
    torch.testing.assert_close(layer.unpack(), w, rtol=0, atol=0)
    for m in [*range(1, 10), 16, 17, 23]:
        x = torch.randn(m, k).to(dtype)
        got = layer(x)
        assert got.dtype == dtype and got.shape == (m, n)
        want = _product(x, w, b)
        if dtype == torch.float32:  # fp32 sums of k terms of magnitude ~1
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 + 1e-7 * k)
        else:
            # fp32 sums rounded once to bf16: within one bf16 rounding (2^-8 relative) of
            # the exact product, plus the fp32 sums' own error
            tol = want.abs() * 2**-8 + 1e-4 * k
            assert ((got.double() - want).abs() <= tol).all()


@each_build
@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("n", [80, 50, 37])  # blocks of 16: 5, 4 (the last partial), 3
def test_a_rows_output_does_not_depend_on_its_batch(
    dtype: torch.dtype, out_dtype: torch.dtype | None, n: int
) -> None:
    """AVX-512: one block per pass below 16 rows, two from 16 on (the odd last block alone),
    six or eight rows at a time; AVX2: one block, three rows at a time. Every row's outputs
    are the same bits in every batch."""
    _needs(dtype)
    torch.manual_seed(n)
    k = 67
    layer = PackedLinear(torch.randn(n, k).to(dtype), torch.randn(n).to(dtype), out_dtype)
    x = torch.randn(40, k).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    for m in (7, 15, 16, 21, 40):
        torch.testing.assert_close(layer(x[:m]), alone[:m], rtol=0, atol=0)


@each_build
@pytest.mark.parametrize("dtype", DTYPES)
def test_bf16_odd_k_ignores_the_next_row(dtype: torch.dtype) -> None:
    """With an odd k the last pair of a row is padded: the next row's first value (here
    inf) never enters the product."""
    _needs(dtype)
    w = torch.randn(20, 7).to(dtype)
    x = torch.randn(2, 7).to(dtype)
    x[1, 0] = float("inf")
    got = PackedLinear(w)(x)
    assert torch.isfinite(got[0]).all()
    torch.testing.assert_close(got[0].double(), _product(x[:1], w, None)[0], rtol=0.02, atol=0.05)


@each_build
@pytest.mark.parametrize("dtype", DTYPES)
def test_no_rows(dtype: torch.dtype) -> None:
    _needs(dtype)
    layer = PackedLinear(torch.randn(20, 8).to(dtype))
    assert layer(torch.empty(0, 8, dtype=dtype)).shape == (0, 20)


@each_build
@pytest.mark.parametrize(
    "x",
    [
        torch.randn(2, 8, dtype=torch.float64),  # wrong dtype
        torch.randn(2, 9),  # wrong k
        torch.randn(2, 1, 8),  # not 2-D
        torch.randn(8, 2).T,  # not contiguous
    ],
)
def test_rejects_an_input_that_does_not_fit(x: torch.Tensor) -> None:
    with pytest.raises(NativeLinearError, match="x must be"):
        PackedLinear(torch.randn(20, 8))(x)


@each_build
@pytest.mark.parametrize(
    "bias", [torch.randn(19), torch.randn(20, dtype=torch.float64), torch.randn(40)[::2]]
)
def test_rejects_a_bias_that_does_not_fit(bias: torch.Tensor) -> None:
    with pytest.raises(NativeLinearError, match="bias must be"):
        PackedLinear(torch.randn(20, 8), bias)


@each_build
def test_rejects_weights_it_cannot_pack() -> None:
    with pytest.raises(NativeLinearError, match="2-D CPU"):
        PackedLinear(torch.randn(20))
    with pytest.raises(NativeLinearError, match=r"cannot run torch\.float16"):
        PackedLinear(torch.randn(20, 8, dtype=torch.float16))


@each_build
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_products_can_hand_out_float32_sums(bias: bool) -> None:
    """An LM head's logits: the fp32 sums unrounded, which round to the bf16 outputs."""
    _needs(torch.bfloat16)
    torch.manual_seed(3)
    w = torch.randn(100, 64).to(torch.bfloat16)
    b = torch.randn(100).to(torch.bfloat16) if bias else None
    x = torch.randn(5, 64).to(torch.bfloat16)
    got = PackedLinear(w, b, out_dtype=torch.float32)(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _product(x, w, b), rtol=1e-5, atol=1e-4)
    rounded = PackedLinear(w, b)(x)
    torch.testing.assert_close(got.to(torch.bfloat16), rounded, rtol=0, atol=0)
    with pytest.raises(NativeLinearError, match=r"float32, not torch\.float16"):
        PackedLinear(w, out_dtype=torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_layers_hand_out_their_out_dtype(dtype: torch.dtype) -> None:
    """Whichever path runs, a layer built with out_dtype=float32 returns float32."""
    layer = Linear(8, 20, True, dtype, torch.device("cpu"), out_dtype=torch.float32)
    layer.load_weight("w", torch.randn(20, 8).to(dtype))
    pack_linears(layer)
    assert layer(torch.randn(3, 8).to(dtype)).dtype == torch.float32
