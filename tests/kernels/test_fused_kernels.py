"""The native fused elementwise kernels (RMSNorm with residual add, RoPE in place,
SiLU * up) against float64 formulas, and bit for bit against the torch ops they replace in
bfloat16 (their roundings are the same); the layers' native and torch paths agree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowllm.kernels import fused
from flowllm.kernels.reference import KernelInputError
from flowllm.models.layers import (
    GatedActivation,
    LayerNorm,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    gelu_tanh,
)
from flowllm.models.rope import rope_frequencies, rope_parameters

pytestmark = pytest.mark.usefixtures("native_build")  # each build in turn
CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 0}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "d"), [(1, 576), (3, 50), (17, 768)])
def test_rms_norm(dtype: torch.dtype, n: int, d: int) -> None:
    torch.manual_seed(n * d)
    x, residual = torch.randn(n, d).to(dtype), torch.randn(n, d).to(dtype)
    weight = (0.5 + torch.rand(d)).to(dtype)
    total = residual + x
    stream = residual.clone()
    got = fused.rms_norm(x, weight, 1e-5, stream)
    assert torch.equal(stream, total)  # the sum, rounded as torch rounds it
    h = total.double()
    want = h * (h.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * weight.double()
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    else:  # the transformers formula: the normalized row is rounded before the weight
        norm = RMSNorm(d, 1e-5, dtype, CPU)
        norm.weight.data.copy_(weight)
        torch.testing.assert_close(got, norm.torch_forward(total), rtol=0, atol=0)
    torch.testing.assert_close(fused.rms_norm(total, weight, 1e-5), got, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "d"), [(1, 768), (3, 50), (17, 64)])
def test_layer_norm(dtype: torch.dtype, n: int, d: int) -> None:
    torch.manual_seed(n * d)
    x, residual = (3 + torch.randn(n, d)).to(dtype), torch.randn(n, d).to(dtype)
    weight, bias = (0.5 + torch.rand(d)).to(dtype), torch.randn(d).to(dtype)
    total = residual + x
    stream = residual.clone()
    got = fused.layer_norm(x, weight, bias, 1e-5, stream)
    assert torch.equal(stream, total)  # the sum, rounded as torch rounds it
    h = total.double()
    centered = h - h.mean(-1, keepdim=True)
    want = centered * (centered.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt()
    want = want * weight.double() + bias.double()
    torch_ln = F.layer_norm(total, (d,), weight, bias, 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:  # float32 math rounded once, as torch's: at most one bf16 step from it
        assert (got.float() - torch_ln.float()).abs().max() <= 2 * want.abs().max() * 2**-8
        assert (got == torch_ln).float().mean() > 0.95
    torch.testing.assert_close(fused.layer_norm(total, weight, bias, 1e-5), got, rtol=0, atol=0)
    norm = LayerNorm(d, 1e-5, dtype, CPU)
    norm.weight.data.copy_(weight)
    norm.bias.data.copy_(bias)
    torch.testing.assert_close(norm(total), got, rtol=0, atol=0)
    torch.testing.assert_close(norm.torch_forward(total), torch_ln, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim", "rot"), [(12, 64, 64), (3, 32, 16), (5, 48, 48)])
def test_rope_in_place_on_strided_rows(
    dtype: torch.dtype, heads: int, head_dim: int, rot: int
) -> None:
    torch.manual_seed(heads)
    cfg = {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": rot / head_dim}}
    inv_freq = rope_frequencies(cfg, rope_parameters(cfg), head_dim).inv_freq
    rotary = RotaryEmbedding(inv_freq, 300, dtype, CPU)
    n, row = 6, heads * head_dim + 40  # rows of a fused projection: rotated heads, then more
    x = torch.randn(n, row).to(dtype)
    positions = torch.tensor([0, 1, 15, 16, 200, 299])
    got = x.clone()
    fused.rope_(got, heads, head_dim, rotary.table, positions)
    assert torch.equal(got[:, heads * head_dim :], x[:, heads * head_dim :])
    heads_x = x[:, : heads * head_dim].view(n, heads, head_dim).double()
    angles = positions[:, None].double() * rotary.inv_freq.double()[None, :]  # [n, rot / 2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = heads_x[..., : rot // 2], heads_x[..., rot // 2 : rot]
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, heads_x[..., rot:]), -1)
    tol = 2e-5 if dtype == torch.float32 else 0.05
    got_heads = got[:, : heads * head_dim].view(n, heads, head_dim)
    torch.testing.assert_close(got_heads.double(), want, rtol=tol, atol=tol)
    # the layer's two paths agree: torch's ops on the same table rows
    native = rotary.for_step(positions, 300).rotate(x.clone(), heads, head_dim)
    plain = apply_rotary(
        x[:, : heads * head_dim].view(n, heads, head_dim), *rotary.lookup(positions, 300)
    )
    torch.testing.assert_close(native, plain, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 37])
def test_silu_mul(dtype: torch.dtype, inter: int) -> None:
    torch.manual_seed(inter)
    gate_up = (6 * torch.randn(5, 2 * inter)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamped ends
    got = fused.silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, -1)
    torch.testing.assert_close(
        got.double(),
        gate * torch.sigmoid(gate) * up,
        rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
        atol=1e-5,
    )
    g, u = gate_up.chunk(2, -1)
    torch.testing.assert_close(got, F.silu(g) * u, **_tol(dtype))
    torch.testing.assert_close(GatedActivation("silu", "Llama")(gate_up), got, rtol=0, atol=0)


def test_inputs_are_checked() -> None:
    x = torch.randn(2, 8)
    x_before = x.clone()
    with pytest.raises(KernelInputError, match="weight"):
        fused.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(KernelInputError, match="x must be contiguous"):
        fused.rms_norm(x.t().contiguous().t(), torch.ones(8), 1e-5)
    with pytest.raises(KernelInputError, match="residual"):
        fused.rms_norm(x, torch.ones(8), 1e-5, torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(KernelInputError, match=r"gate_up must be \[n, 2 \* inter\]"):
        fused.silu_mul(torch.randn(2, 7))
    table = torch.zeros(4, 2, 8)
    with pytest.raises(KernelInputError, match="positions"):
        fused.rope_(x, 1, 8, table, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(KernelInputError, match="2 of 2 positions fall outside"):
        fused.rope_(x, 1, 8, table, torch.tensor([4, -1]))
    assert torch.equal(x, x_before)  # nothing written
    with pytest.raises(KernelInputError, match="unit column stride"):
        fused.rope_(x.t(), 1, 8, table, torch.zeros(8, dtype=torch.int64))
    assert not fused.serves(x.half())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(256, 3072), (3, 37), (1, 5000)])
def test_gelu_tanh(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.manual_seed(shape[1])
    x = (4 * torch.randn(shape)).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -3.0])  # tanh's saturated ends
    got = fused.gelu_tanh(x)
    h = x.double()
    want = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the result
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=1e-5)
    torch.testing.assert_close(got, F.gelu(x, approximate="tanh"), rtol=tol, atol=1e-5)
    torch.testing.assert_close(gelu_tanh(x), got, rtol=0, atol=0)  # the layers' entry
