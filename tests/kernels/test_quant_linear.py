"""Quantized linear layers against gguf's own dequantization and a torch product, on both
builds of the native kernels (AVX-512 and AVX2), and without them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from quant_blocks import random_blocks

from flowllm.kernels import call_plan, native, quant_linear
from flowllm.kernels.quant_linear import QuantError, QuantizedLinear, QuantizedWeight

# Each build of the products: AVX-512 with VNNI's byte dots and without (pmaddubsw, as on
# CPUs lacking VNNI), and AVX2.
BUILDS = {
    "avx512": ("avx512", frozenset()),
    "avx512-no-vnni": ("avx512", frozenset({"avx512_vnni"})),
    "avx2": ("avx2", frozenset()),
}
ISAS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            not native.cpu_flags() >= native.ISAS[isa].cpu_flags, reason=f"no {isa} here"
        ),
    )
    for name, (isa, _) in BUILDS.items()
]


def build(name: str) -> native.NativeLibrary:
    """Build `name`'s library, active: the ops run its kernels until the test ends."""
    isa, without = BUILDS[name]
    lib = native.isa_library(isa, without=without)
    lib.activate()
    return lib


@pytest.fixture(autouse=True)
def _default_build_after() -> Iterator[None]:
    """The process's own build active again after each test (`build` switches)."""
    yield
    native.reload()


N, K = 80, 512  # 5 blocks of 16 outputs; two K-format super-blocks per row


def reference(raw: np.ndarray, type_name: str, n: int = N, k: int = K) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(np.float32))


def rounded_x(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 in blocks of 32 (scale absmax / 127, to nearest even), as values,
    in float32 arithmetic as the kernel does it (numpy: torch's scalar / tensor multiplies
    by a reciprocal, which rounds some ties the other way)."""
    m, k = x.shape
    blocks = x.numpy().reshape(m, k // 32, 32)
    top = np.abs(blocks).max(-1, keepdims=True)
    inv = np.where(top > 0, np.float32(127.0) / np.where(top > 0, top, 1), 0).astype(np.float32)
    values = np.rint(blocks * inv) * (top / np.float32(127.0))
    return torch.from_numpy(values.astype(np.float32).reshape(m, k))


def assert_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, exact_x: bool) -> None:
    """y against x W^T by torch, within float32 rounding: x as it is, or (an integer
    product) x rounded to int8 in blocks of 32, offsets included: the product is exactly
    the weights' values against the rounded x, as llama.cpp's Q8_1 products are."""
    if not exact_x:
        x = rounded_x(x)
    expect = x @ w.T
    slack = 1e-5 * (x.abs() @ w.abs().T) + 1e-6
    assert y.shape == expect.shape
    assert ((y - expect).abs() <= slack).all(), float(((y - expect).abs() / slack).max())


@pytest.mark.parametrize("type_name", quant_linear.GGUF_FORMATS)
def test_repacked_values_are_ggufs_bit_for_bit(type_name: str) -> None:
    raw = random_blocks(type_name, N, K)
    weight = quant_linear.from_gguf(raw, type_name, (N, K))
    assert torch.equal(weight.dequantize(), reference(raw, type_name))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", quant_linear.GGUF_FORMATS)
def test_products_match_dequantize_then_matmul(isa: str, type_name: str) -> None:
    raw = random_blocks(type_name, N, K, seed=1)
    w = reference(raw, type_name)
    bias = torch.randn(N)
    lin = QuantizedLinear(quant_linear.from_gguf(raw, type_name, (N, K)), bias, lib=build(isa))
    assert torch.equal(lin.rows(None, 0, N), w)  # the kernel's dequantization
    ids = torch.tensor([3, 0, N - 1, 3])
    assert torch.equal(lin.rows(ids), w[ids])
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15):  # every group of rows a pass takes
        x = torch.randn(m, K)
        y = lin(x)
        assert y.dtype == torch.float32
        assert_product(y - bias, x, w, exact_x=type_name == "Q6_K")


def assert_rows_alone(lin: QuantizedLinear, x: torch.Tensor) -> None:
    """Each row of lin(x) equals the row multiplied alone, and within other companies:
    the product of a row depends on that row only."""
    y = lin(x)
    for i in range(x.shape[0]):
        assert torch.equal(y[i], lin(x[i : i + 1])[0]), i
    assert torch.equal(y[5:], lin(x[5:]))
    assert torch.equal(y[[7, 2, 30]], lin(x[[7, 2, 30]]))


@pytest.mark.parametrize("isa", [*ISAS, "torch"])
@pytest.mark.parametrize("type_name", quant_linear.GGUF_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_depends_on_that_row_only(
    isa: str, type_name: str, dtype: torch.dtype
) -> None:
    """Batch invariance: products of 1 to 40 rows (a decode row, prefill chunks, mixed
    steps) give each row the same bits, on every build and without the library."""
    raw = random_blocks(type_name, N, K, seed=7)
    bias = torch.randn(N).to(dtype)
    weight = quant_linear.from_gguf(raw, type_name, (N, K))
    lin = QuantizedLinear(weight, bias, out_dtype=dtype, lib=None if isa == "torch" else build(isa))
    if isa == "torch":
        lin.lib = None
    assert_rows_alone(lin, torch.randn(40, K).to(dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", quant_linear.GGUF_FORMATS)
def test_bf16_activations_give_the_float32_product_rounded_once(isa: str, type_name: str) -> None:
    """bf16 x, bias and y go through the kernel unconverted (a decode step replays them
    without torch ops) and give the float32 product of the same values, rounded to bf16."""
    n = N + 8
    raw = random_blocks(type_name, n, K, seed=5)
    weight = quant_linear.from_gguf(raw, type_name, (n, K))
    lib = build(isa)
    assert lib is not None
    bias = torch.randn(n).to(torch.bfloat16)
    lin = QuantizedLinear(weight, bias, out_dtype=torch.bfloat16, lib=lib)
    lin32 = QuantizedLinear(weight, bias.float(), lib=lib)
    for m in (1, 3, 8, 9, 40):
        x = torch.randn(m, K).to(torch.bfloat16)
        recorded = call_plan.record(lambda a: (lin(a),), (x,))
        assert recorded.plan is not None, recorded.refused
        (y,) = recorded.outputs
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, lin32(x.float()).to(torch.bfloat16))
        x2 = torch.randn(m, K).to(torch.bfloat16)
        (replayed,) = recorded.plan.replay((x2,))
        assert torch.equal(replayed, lin32(x2.float()).to(torch.bfloat16))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K"])
def test_outputs_past_the_last_group_of_16(isa: str, type_name: str) -> None:
    """Products run 16 outputs at a time where they can; the n % 16 last ones, and the
    first ones, match the reference too."""
    n = N + 8
    raw = random_blocks(type_name, n, K, seed=3)
    w = reference(raw, type_name, n)
    lin = QuantizedLinear(quant_linear.from_gguf(raw, type_name, (n, K)), lib=build(isa))
    for m in (1, 8, 11):
        x = torch.randn(m, K)
        assert_product(lin(x), x, w, exact_x=False)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K", "Q5_K"])
def test_interleaving_keeps_every_value(type_name: str) -> None:
    """The group kernel's layout (16 rows' codes 4 bytes at a time, their scales side by
    side, rows padded to 16) holds the same values, and turns back into the row layout."""
    n = N + 5
    raw = random_blocks(type_name, n, K, seed=5)
    weight = quant_linear.from_gguf(raw, type_name, (n, K))
    grouped = weight.interleave()
    assert grouped.interleaved and grouped.shape == (N + 16, K)
    assert weight.interleave() is grouped  # made once, shared by every product over it
    assert not torch.equal(grouped.codes[:16], weight.codes[:16])  # the bytes did move
    assert torch.equal(grouped.dequantize()[:n], reference(raw, type_name, n))
    assert torch.equal(grouped.dequantize()[n:], torch.zeros(11, K))
    back = grouped.in_rows()
    assert torch.equal(back.codes[:n], weight.codes) and torch.equal(back.scales[:n], weight.scales)


@pytest.mark.parametrize("isa", ISAS)
def test_each_product_reads_its_own_layout(isa: str) -> None:
    """Integer weights interleave at load and float ones (groups of 16) stay in rows; the
    kernel refuses an integer weight in rows instead of misreading it, and a float weight
    cannot interleave."""
    lib = build(isa)
    x = torch.randn(2, K)
    q4, q6 = (
        quant_linear.from_gguf(random_blocks(t, N, K, seed=6), t, (N, K)) for t in ("Q4_1", "Q6_K")
    )
    for weight, exact_x in ((q4, False), (q6, True)):
        lin = QuantizedLinear(weight, lib=lib)
        assert lin.weight.interleaved == weight.integer
        assert_product(lin(x), x, weight.dequantize(), exact_x=exact_x)
    assert q4.integer and not q6.integer
    with pytest.raises(QuantError, match="cannot interleave"):
        replace(q6, interleaved=True)
    lin = QuantizedLinear(q4, lib=lib)
    lin.weight = q4
    with pytest.raises(QuantError, match="refused"):
        lin(x)


def test_rounding_x_to_int8_is_what_the_bound_allows() -> None:
    """assert_product is tight enough to catch a wrong block scale (x rounded to 4 bits
    instead of 8), and a product that rounds x but adds the offsets against x's exact sum."""
    w = torch.randn(N, K)
    x = torch.randn(2, K)
    step = x.view(2, K // 32, 32).abs().amax(-1, keepdim=True) / 7
    coarse = (torch.round(x.view(2, K // 32, 32) / step) * step).view(2, K)
    with pytest.raises(AssertionError):
        assert_product(coarse @ w.T, x, w, exact_x=False)
    scales, mins = torch.rand(N, K // 32, 1) / 8, torch.rand(N, K // 32, 1) - 0.5
    codes = torch.randint(0, 16, (N, K // 32, 32)).float()
    w = (codes * scales + mins).view(N, K)
    offsets_on_exact_x = rounded_x(x) @ (codes * scales).view(N, K).T + torch.einsum(
        "mb,nb->mn", x.view(2, K // 32, 32).sum(-1), mins[..., 0]
    )
    with pytest.raises(AssertionError):
        assert_product(offsets_on_exact_x, x, w, exact_x=False)
    assert_product(rounded_x(x) @ w.T, x, w, exact_x=False)


def test_without_the_native_library_torch_runs_the_same_products() -> None:
    raw = random_blocks("Q4_K", N, K, seed=2)
    weight = quant_linear.from_gguf(raw, "Q4_K", (N, K))
    lin = QuantizedLinear(weight, None, out_dtype=torch.bfloat16)
    lin.lib = None
    x = torch.randn(3, K)
    expect = (x @ reference(raw, "Q4_K").T).to(torch.bfloat16)
    torch.testing.assert_close(lin(x), expect)
    assert torch.equal(lin.rows(torch.tensor([5, 1])), reference(raw, "Q4_K")[[5, 1]])


@pytest.mark.parametrize("isa", ISAS)
def test_fused_parts_of_different_formats(isa: str) -> None:
    """A Q4_K_M file's q/k (Q4_K) and v (Q6_K) fuse into one weight of the widest layout."""
    parts = [("Q4_K", 64), ("Q6_K", 32), ("Q8_0", 16)]
    raws = [random_blocks(t, n, K, seed=i) for i, (t, n) in enumerate(parts)]
    fused = QuantizedWeight.concat(
        [quant_linear.from_gguf(r, t, (n, K)) for r, (t, n) in zip(raws, parts, strict=True)]
    )
    w = torch.cat([reference(r, t, n) for r, (t, n) in zip(raws, parts, strict=True)])
    assert fused.kind == "q8" and fused.group == 16
    assert torch.equal(fused.dequantize(), w)
    lin = QuantizedLinear(fused, lib=build(isa))
    x = torch.randn(2, K)
    assert_product(lin(x), x, w, exact_x=True)  # groups of 16 multiply floats


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k", [96, 128])  # rows of whole 64s multiply on integers
def test_int8_per_channel(isa: str, k: int) -> None:
    w = torch.randn(48, k) * torch.linspace(0.1, 3.0, 48)[:, None]
    weight = quant_linear.int8_per_channel(w)
    assert weight.codes.dtype == torch.int8 and weight.scales.shape == (48, 1)
    deq = weight.dequantize()
    # half a step of each row's own scale at most, and the float32 rounding of q * s
    assert ((deq - w).abs() <= weight.scales / 2 + 1e-6 * w.abs()).all()
    lin = QuantizedLinear(weight, lib=build(isa))
    x = torch.randn(3, k)
    assert_product(lin(x), x, deq, exact_x=k % 64 != 0)


def test_bad_input_is_refused_clearly() -> None:
    raw = random_blocks("Q4_0", N, K)
    lin = QuantizedLinear(quant_linear.from_gguf(raw, "Q4_0", (N, K)))
    with pytest.raises(QuantError, match="x must be"):
        lin(torch.randn(2, K + 1))
    if lin.lib is not None:
        with pytest.raises(IndexError, match="outside"):
            lin.rows(torch.tensor([0, N]))
    with pytest.raises(QuantError, match="not whole blocks"):
        quant_linear.from_gguf(raw, "Q4_K", (N, K - 32))
    with pytest.raises(QuantError, match="not served quantized"):
        quant_linear.from_gguf(raw, "IQ2_XS", (N, K))
    with pytest.raises(QuantError, match="multiple of 16"):
        quant_linear.int8_per_channel(torch.randn(4, 20))
