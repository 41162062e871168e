"""Greedy sampling's argmax along logit rows: `torch.argmax(x, dim=1)`, faster on CPU.

torch's CPU argmax along rows is a scalar loop. With the native library, `csrc/argmax.c`
does one vectorized pass per row (rows split across threads from 1M logits on). Without
it, from `BLOCKED_FROM` logits on, the rows go by blocks through vectorized torch ops: the
max of each 64-token block (amax), the first block holding the row's max, then the first
maximal index inside that block. Both give exactly argmax's index: the first maximum, a NaN
before anything (amax propagates NaN as argmax ranks it). Timings are in
benchmarks/README.md "Pipeline overhead".
"""

from __future__ import annotations

import torch

from flowllm.kernels import native

BLOCKED_FROM = 1 << 15  # torch fallback: from this many logits on, argmax by blocks
_BLOCK = 64  # torch fallback: block length


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=1)` of [R, V] float32 logits, as int64 [R]."""
    if not x.is_cpu:  # a GPU's own argmax is one parallel pass
        return x.argmax(dim=1)
    if native.library() is not None and x.dtype is torch.float32 and x.stride(1) == 1:
        rows, vocab = x.shape
        if rows and vocab:
            out = torch.empty(rows, dtype=torch.int64)
            torch.ops.flowllm.argmax_rows(x, out)
            return out
    return blocked_argmax_rows(x)


def blocked_argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=1)` through vectorized torch ops (see the module docstring)."""
    rows, vocab = x.shape
    # the blocks' fixed cost outweighs torch's scalar loop on small inputs
    # (benchmarks/README.md, "Kernel design figures")
    if rows * vocab < BLOCKED_FROM or vocab < 2 * _BLOCK:
        return x.argmax(dim=1)
    blk = _BLOCK
    nb = vocab // blk
    block_max = x[:, : nb * blk].reshape(rows, nb, blk).amax(dim=-1)  # [R, NB]
    if vocab % blk:
        tail = x[:, nb * blk :].amax(dim=-1, keepdim=True)  # [R, 1]
        block_max = torch.cat([block_max, tail], dim=1)
    b = block_max.argmax(dim=1, keepdim=True)  # [R, 1] first block holding the max
    # Columns past the end repeat the last one; they follow it, so never come first.
    cols = (b * blk + torch.arange(blk, device=x.device)).clamp_(max=vocab - 1)  # [R, blk]
    return (b * blk).squeeze(1) + x.gather(1, cols).argmax(dim=1)
