"""Fused elementwise ops in C (`csrc/elementwise.c`): a Llama layer's RMSNorm after the
residual add, rotary embeddings in place and SiLU(gate) * up; GPT-2's LayerNorm after the
residual add and its tanh GELU.

At batch 1 a SmolLM2 layer ran ~25 small torch calls around its four products, each
paying torch's fixed cost; these kernels replace most of them with one C call each. They
serve float32 and bfloat16 CPU tensors, contiguous (the rotary kernel takes a row stride);
`serves` tells the layers when to call them, and the layers keep their torch formulas for
everything else (other dtypes and devices, no native library). The ops check their
arguments; what they refuse raises `KernelInputError`. Figures in
benchmarks/README.md "Kernel design figures".
"""

from __future__ import annotations

import torch

from flowllm.kernels import native

_DTYPES = (torch.float32, torch.bfloat16)


def serves(x: torch.Tensor) -> bool:
    """Whether these kernels run ops on `x` (a CPU float32/bfloat16 tensor, native library
    present)."""
    return x.is_cpu and x.dtype in _DTYPES and native.library() is not None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x, or of `residual + x` when a residual is given (the sum is written back
    into `residual`, rounded to its dtype, as the next layer's residual stream)."""
    # x, residual: [n, d]; weight: [d] -> [n, d]
    out = torch.empty_like(x)
    native.call(torch.ops.flowllm.rms_norm, x, residual, weight, out, eps)
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
    out = torch.empty_like(x)
    native.call(torch.ops.flowllm.layer_norm, x, residual, weight, bias, out, eps)
    return out


def rope_(
    x: torch.Tensor, heads: int, head_dim: int, table: torch.Tensor, positions: torch.Tensor
) -> None:
    """Rotate, in place, the first `heads` heads of each row of x by their position's row
    of `table` ([max_pos, 2, rot]: (cos | cos) and (-sin | sin), see RotaryEmbedding);
    nothing when a position falls outside the table."""
    # x: [n, row] with unit column stride (rows may be longer than heads * head_dim)
    native.call(torch.ops.flowllm.rope, x, table, positions, heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the [gate | up] halves of each row."""
    # gate_up: [n, 2 * inter] -> [n, inter]
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[-1] // 2)
    native.call(torch.ops.flowllm.silu_mul, gate_up, out)
    return out


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's `gelu_new`), elementwise."""
    out = torch.empty_like(x)
    native.call(torch.ops.flowllm.gelu_tanh, x, out)
    return out
