"""The model layers against independent references: RMSNorm against transformers' own
(bit for bit, fp32 and bf16), RoPE against the rotate-half formula, packed linear
layers against `F.linear` in float64, and each activation the same bits for a row among
any rows, on every kernel build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from flowllm.kernels import cpu_linear
from flowllm.models import layers
from flowllm.models.layers import (
    ACTIVATIONS,
    GatedActivation,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
)

CPU = torch.device("cpu")


def _rms_norms(dtype: torch.dtype) -> tuple[RMSNorm, LlamaRMSNorm, torch.Tensor]:
    torch.manual_seed(0)
    weight = 1 + 0.3 * torch.randn(96)
    ours = RMSNorm(96, 1e-5, dtype, CPU)
    ref = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ref.weight.copy_(weight)
    return ours, ref, (3 * torch.randn(7, 96)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_torch_path_equals_transformers(dtype: torch.dtype) -> None:
    ours, ref, x = _rms_norms(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(ours.torch_forward(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_transformers(dtype: torch.dtype) -> None:
    """Whichever path runs (the native kernel where it serves): bf16 bit for bit, fp32 up to
    the order of the float32 sum."""
    ours, ref, x = _rms_norms(dtype)
    tol = 1e-6 if dtype == torch.float32 else 0.0
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), ref(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_and_norm_is_the_sum_then_the_norm(dtype: torch.dtype) -> None:
    ours, ref, x = _rms_norms(dtype)
    residual = torch.randn(7, 96).to(dtype)
    total = residual + x  # rounded to dtype, as the layer's residual stream is
    tol = 1e-6 if dtype == torch.float32 else 0.0
    with torch.inference_mode():
        out, new_residual = ours.add_and_norm(x, residual.clone())
        torch.testing.assert_close(new_residual, total, rtol=0, atol=0)
        torch.testing.assert_close(out, ref(total), rtol=tol, atol=tol)


def test_rotary_matches_rotate_half() -> None:
    """Table lookup + apply_rotary against q * cos + rotate_half(q) * sin, on a strided
    input (a slice of a fused projection); past the table's end it grows."""
    n, heads, dim = 5, 3, 16
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, dim, 2).float() / dim))
    rotary = RotaryEmbedding(inv_freq, 8, torch.float32, CPU)
    positions = torch.tensor([0, 3, 7, 12, 30])  # 12 and 30 lie past the initial table
    fused = torch.randn(n, 2 * heads * dim)
    x = fused[:, : heads * dim].view(n, heads, dim)  # row stride 2 * heads * dim
    got = apply_rotary(x, *rotary.lookup(positions, 31))
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [n, 1, dim]
    rotate_half = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), dim=-1)
    assert got.is_contiguous()
    torch.testing.assert_close(got, x * emb.cos() + rotate_half * emb.sin())


def test_partial_rotary_passes_the_rest_through() -> None:
    n, heads, dim, rot = 4, 2, 16, 8
    x = torch.randn(n, heads, dim)
    freqs = torch.randn(n, rot // 2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [n, 1, rot]
    signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)[:, None, :]
    got = apply_rotary(x, emb.cos(), signed_sin)
    r = x[..., :rot]
    rotate_half = torch.cat((-r[..., rot // 2 :], r[..., : rot // 2]), dim=-1)
    torch.testing.assert_close(got[..., :rot], r * emb.cos() + rotate_half * emb.sin())
    torch.testing.assert_close(got[..., rot:], x[..., rot:], rtol=0, atol=0)


AVAILABLE = {
    "native": lambda dtype: cpu_linear.serves(dtype),
    "onednn": lambda dtype: layers.onednn_packs(dtype, CPU),
}


@pytest.mark.parametrize("layout", ["native", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_packed_linear_matches_float64(
    layout: str, dtype: torch.dtype, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed layer computes x W^T + b for any number of rows (one packing serves all),
    in either packed layout; unpacking gives W back exactly."""
    if not AVAILABLE[layout](dtype):
        pytest.skip(f"no {layout} packing for {dtype} here")
    monkeypatch.setattr(layers, "weight_layout", lambda dtype, device: layout)
    torch.manual_seed(rows)
    w, b = torch.randn(72, 40).to(dtype), torch.randn(72).to(dtype)
    layer = Linear(40, 72, True, dtype, CPU)
    layer.load_weight("w", w)
    layer.load_bias("b", b)
    layer.pack()
    assert layer.weight is None
    assert (layer.native_weight is not None) is (layout == "native")
    assert (layer.packed_weight is not None) is (layout == "onednn")
    x = torch.randn(rows, 40).to(dtype)
    with torch.inference_mode():
        got = layer(x)
    want = F.linear(x.double(), w.double(), b.double())
    tol = 1e-4 if dtype == torch.float32 else 0.1  # bf16: the output's rounding
    assert got.dtype == dtype and got.shape == (rows, 72)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(layer.dense_weight(), w, rtol=0, atol=0)
    layer.unpack()
    assert layer.packed_weight is None and layer.native_weight is None
    torch.testing.assert_close(layer.weight, w, rtol=0, atol=0)


def test_linear_layout_follows_the_machine() -> None:
    """fp32, and bf16 where the CPU has AVX512-BF16, go to the native kernel wherever it
    builds; fp16 keeps oneDNN (or plain weights)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = "native" if cpu_linear.serves(dtype) else None
        want = want or ("onednn" if layers.onednn_packs(dtype, CPU) else "plain")
        assert Linear(8, 8, False, dtype, CPU).layout == want
    assert not cpu_linear.serves(torch.float16)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_activation_gives_a_row_the_same_bits_among_any_rows(
    name: str, dtype: torch.dtype, kernel_build: str
) -> None:
    """Every row alone, and groups whose values run on one thread and on several, against
    all 160 rows at once, at widths no multiple of a vector: torch's scalar tails, placed by
    a call's size, would move a row's values with its company."""
    act, gated = ACTIVATIONS[name], GatedActivation(name, "test")
    for width in (37, 48, 1000):
        gen = torch.Generator().manual_seed(width)
        x = (4 * torch.randn(160, 2 * width, generator=gen)).to(dtype)
        plain, both = act(x), gated(x)
        groups = [(row, 1) for row in range(160)] + [(3, 2), (10, 7), (40, 120)]
        for start, rows in groups:
            part, end = x[start : start + rows], start + rows
            assert torch.equal(act(part), plain[start:end]), (width, start, rows)
            assert torch.equal(gated(part), both[start:end]), (width, start, rows)
