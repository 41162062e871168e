"""y = x W^T + b on CPU with the native kernel of `csrc/linear.c`.

The kernel reads W in 16-output blocks stored column by column (see `csrc/linear.c`), so
a product streams one run of memory, faster than oneDNN's packed products read theirs
(benchmarks/README.md "Linear step").
`PackedLinear` packs W [out, in] into that layout once, checks each call's arguments
(shape, dtype, contiguity, device) and runs the kernel as the op `torch.ops.flowllm.linear`,
so a product's fixed cost is the checks, the output's allocation and one op call, below
oneDNN's per-call cost (benchmarks/README.md "Linear step" and "Kernel design figures").
"""

from __future__ import annotations

import torch

from flowllm.kernels import native

BLOCK = 16  # outputs per block (csrc/linear.c BLOCK)

DTYPES = (torch.float32, torch.bfloat16)


class NativeLinearError(ValueError):
    """The arguments do not fit the kernel (shape, dtype, layout), or it cannot run here."""


def serves(dtype: torch.dtype) -> bool:
    """Whether the native kernel runs products in `dtype` on this machine."""
    lib = native.library()
    if lib is None or dtype not in DTYPES:
        return False
    return dtype != torch.bfloat16 or lib.has_bf16


def pack(w: torch.Tensor) -> torch.Tensor:
    """W [n, k] in the kernel's layout, zero-padded: fp32 [n'/16, k, 16], bf16
    [n'/16, k'/2, 16, 2], with n' = n rounded up to 16 and k' = k rounded up to even."""
    n, k = w.shape
    blocks = -(-n // BLOCK)
    if w.dtype == torch.bfloat16:
        padded = w.new_zeros(blocks * BLOCK, k + k % 2)  # [n', k']
        padded[:n, :k] = w
        # [n'/16, 16, k'/2, 2] -> [n'/16, k'/2, 16, 2]
        return padded.view(blocks, BLOCK, -1, 2).permute(0, 2, 1, 3).contiguous()
    padded = w.new_zeros(blocks * BLOCK, k)  # [n', k]
    padded[:n] = w
    # [n'/16, 16, k] -> [n'/16, k, 16]
    return padded.view(blocks, BLOCK, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """W [n, k] back from `pack`'s layout."""
    if packed.dtype == torch.bfloat16:
        w = packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * BLOCK, -1)
    else:
        w = packed.transpose(1, 2).reshape(packed.shape[0] * BLOCK, -1)
    return w[:n, :k].contiguous()


class PackedLinear:
    """A weight W [out, in] (fp32, or bf16 where the CPU has AVX512-BF16) packed for the
    kernel, with its bias b [out] (kept by reference: loading into it in place is seen);
    calling it computes x W^T + b."""

    def __init__(
        self,
        w: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        if w.dim() != 2 or not w.is_cpu:
            raise NativeLinearError(f"the weight must be a 2-D CPU tensor, got {_describe(w)}")
        self.out_features, self.in_features = n, _ = w.shape
        self.dtype = w.dtype
        if not serves(w.dtype):
            raise NativeLinearError(f"the native linear kernel cannot run {w.dtype} here")
        if bias is not None and (
            bias.dtype != w.dtype
            or bias.shape != (n,)
            or not bias.is_contiguous()
            or not bias.is_cpu
        ):
            raise NativeLinearError(
                f"bias must be contiguous [{n}] {w.dtype}, got {_describe(bias)}"
            )
        # bf16 products may hand their fp32 sums out unrounded (an LM head's logits)
        self.out_dtype = w.dtype if out_dtype is None else out_dtype
        if self.out_dtype not in (w.dtype, torch.float32):
            raise NativeLinearError(
                f"{w.dtype} products give {w.dtype} or float32, not {out_dtype}"
            )
        self.bias = bias
        self.packed = pack(w.detach())

    def unpack(self) -> torch.Tensor:
        """W [out, in] as a new tensor."""
        return unpack(self.packed, self.out_features, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, in] (contiguous, W's dtype) -> [m, out] in `out_dtype`; sums in fp32, bf16
        outputs rounded to nearest even after the bias."""
        # x: [m, in] -> [m, out]
        n, k = self.out_features, self.in_features
        if x.dtype is not self.dtype or x.dim() != 2 or x.shape[1] != k:
            raise NativeLinearError(f"x must be [m, {k}] {self.dtype}, got {_describe(x)}")
        if not (x.is_contiguous() and x.is_cpu):
            raise NativeLinearError(f"x must be contiguous on the CPU, got {_describe(x)}")
        m = x.shape[0]
        y = torch.empty(m, n, dtype=self.out_dtype)
        torch.ops.flowllm.linear(x, self.packed, self.bias, y)
        return y


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}"
