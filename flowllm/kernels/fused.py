"""Fused elementwise ops in C (`csrc/elementwise.c`): a Llama layer's RMSNorm after the
residual add, rotary embeddings in place and SiLU(gate) * up; GPT-2's LayerNorm after the
residual add and its tanh GELU.

At batch 1 a SmolLM2 layer ran ~25 small torch calls around its four products, each
paying torch's fixed cost; these kernels replace most of them with one C call each. They
serve float32 and bfloat16 CPU tensors, contiguous (the rotary kernel takes a row stride);
`serves` tells the layers when to call them, and the layers keep their torch formulas for
everything else (other dtypes and devices, no native library). Figures in
benchmarks/README.md "Kernel design figures".
"""

from __future__ import annotations

import torch

from flowllm.kernels import native
from flowllm.kernels.reference import KernelInputError

_DTYPES = (torch.float32, torch.bfloat16)


def _available() -> None:
    if native.library() is None:
        raise KernelInputError("the native kernels are not available on this machine")


def serves(x: torch.Tensor) -> bool:
    """Whether these kernels run ops on `x` (a CPU float32/bfloat16 tensor, native library
    present)."""
    return x.is_cpu and x.dtype in _DTYPES and native.library() is not None


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype is not dtype or t.shape != shape or not t.is_contiguous():
        raise KernelInputError(
            f"{name} must be a contiguous {dtype} tensor of shape {shape}, got "
            f"{t.dtype} {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}"
        )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x, or of `residual + x` when a residual is given (the sum is written back
    into `residual`, rounded to its dtype, as the next layer's residual stream)."""
    # x, residual: [n, d]; weight: [d] -> [n, d]
    _available()
    out = _norm_output(x, residual, weight)
    torch.ops.flowllm.rms_norm(x, residual, weight, out, eps)
    return out


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """LayerNorm of x, or of `residual + x` written back into `residual` (see rms_norm)."""
    # x, residual: [n, d]; weight, bias: [d] -> [n, d]
    _available()
    out = _norm_output(x, residual, weight, bias)
    torch.ops.flowllm.layer_norm(x, residual, weight, bias, out, eps)
    return out


def _norm_output(
    x: torch.Tensor, residual: torch.Tensor | None, *params: torch.Tensor
) -> torch.Tensor:
    """Check a norm's rows, residual and [d] parameters; its output buffer."""
    n, d = x.shape
    _check("x", x, x.dtype, (n, d))
    for name, p in zip(("weight", "bias"), params, strict=False):
        _check(name, p, x.dtype, (d,))
    if residual is not None:
        _check("residual", residual, x.dtype, (n, d))
    return torch.empty_like(x)


def rope_(
    x: torch.Tensor, heads: int, head_dim: int, table: torch.Tensor, positions: torch.Tensor
) -> None:
    """Rotate, in place, the first `heads` heads of each row of x by their position's row
    of `table` ([max_pos, 2, rot]: (cos | cos) and (-sin | sin), see RotaryEmbedding)."""
    # x: [n, row] with unit column stride (rows may be longer than heads * head_dim)
    _available()
    n = x.shape[0]
    rot = table.shape[-1]
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < heads * head_dim:
        raise KernelInputError(
            f"x must be [n, >= {heads * head_dim}] with unit column stride, got "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    if rot > head_dim or rot % 2 or rot > 1024:
        raise KernelInputError(f"rotary width {rot} must be even and <= head_dim {head_dim}")
    _check("table", table, x.dtype, (table.shape[0], 2, rot))
    _check("positions", positions, torch.int64, (n,))
    try:
        torch.ops.flowllm.rope(x, table, positions, heads, head_dim)
    except ValueError as e:  # positions outside the table
        raise KernelInputError(str(e)) from None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the [gate | up] halves of each row."""
    # gate_up: [n, 2 * inter] -> [n, inter]
    _available()
    n, width = gate_up.shape
    _check("gate_up", gate_up, gate_up.dtype, (n, width))
    if width % 2:
        raise KernelInputError(f"gate_up's width {width} is not even")
    out = gate_up.new_empty(n, width // 2)
    torch.ops.flowllm.silu_mul(gate_up, out)
    return out


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's `gelu_new`), elementwise."""
    _available()
    _check("x", x, x.dtype, tuple(x.shape))
    out = torch.empty_like(x)
    torch.ops.flowllm.gelu_tanh(x, out)
    return out
