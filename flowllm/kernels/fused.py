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

import functools

import torch

from flowllm.kernels import native
from flowllm.kernels.reference import KernelInputError

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class _Kernels:
    """Each kernel by dtype, bound once."""

    def __init__(self, lib: native.NativeLibrary) -> None:
        def by_dtype(name: str) -> dict[torch.dtype, native.Kernel]:
            return {dt: lib.kernel(f"flowllm_{name}_{sfx}") for dt, sfx in _SUFFIX.items()}

        self.rms_norm = by_dtype("rms_norm")
        self.layer_norm = by_dtype("layer_norm")
        self.rope = by_dtype("rope")
        self.silu_mul = by_dtype("silu_mul")
        self.gelu_tanh = by_dtype("gelu_tanh")


def _bound() -> _Kernels | None:
    """The kernels of the loaded library; None without one."""
    lib = native.library()
    return None if lib is None else _bind(lib)


@functools.cache
def _bind(lib: native.NativeLibrary) -> _Kernels:
    return _Kernels(lib)


def _kernels() -> _Kernels:
    k = _bound()
    if k is None:
        raise KernelInputError("the native kernels are not available on this machine")
    return k


def serves(x: torch.Tensor) -> bool:
    """Whether these kernels run ops on `x` (a CPU float32/bfloat16 tensor, native library
    present)."""
    return x.is_cpu and x.dtype in _SUFFIX and _bound() is not None


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
    k = _kernels()
    out = _norm_output(x, residual, weight)
    n, d = x.shape
    k.rms_norm[x.dtype](x=x, residual=residual, weight=weight, out=out, n=n, d=d, eps=eps)
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
    k = _kernels()
    out = _norm_output(x, residual, weight, bias)
    n, d = x.shape
    k.layer_norm[x.dtype](
        x=x, residual=residual, weight=weight, bias=bias, out=out, n=n, d=d, eps=eps
    )
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
    k = _kernels()
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
    outside = k.rope[x.dtype](
        x=x, table=table, table_rows=table.shape[0], positions=positions, n=n, heads=heads,
        head_dim=head_dim, row_stride=x.stride(0), rot=rot,
    )  # fmt: skip
    if outside:
        raise KernelInputError(
            f"{outside} of {n} positions fall outside the rotary table's {table.shape[0]} rows"
        )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the [gate | up] halves of each row."""
    # gate_up: [n, 2 * inter] -> [n, inter]
    k = _kernels()
    n, width = gate_up.shape
    _check("gate_up", gate_up, gate_up.dtype, (n, width))
    if width % 2:
        raise KernelInputError(f"gate_up's width {width} is not even")
    out = gate_up.new_empty(n, width // 2)
    k.silu_mul[gate_up.dtype](gate_up=gate_up, out=out, n=n, inter=width // 2)
    return out


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's `gelu_new`), elementwise."""
    k = _kernels()
    _check("x", x, x.dtype, tuple(x.shape))
    out = torch.empty_like(x)
    k.gelu_tanh[x.dtype](x=x, y=out, numel=x.numel())
    return out
