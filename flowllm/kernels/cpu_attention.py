"""Paged decode attention and the K/V store in C (`csrc/attention.c`), with the checks the
C side relies on.

Why: the torch reference gathers each decode sequence's blocks into a workspace before
attending, and in half precision scores every query head against every kv head (its
block-diagonal product); the kernel reads each K/V row once, where it lies, for the query
heads that share it. float32 and bfloat16 (widened by a shift or a mask: any CPU the
library is built for); the math is float32, bf16 outputs rounded to nearest even.

The ops check shapes, dtypes and strides, and their kernels the index contents (sequence
and row indices, lengths, block ids, slots) before anything is read; either refusal
raises `KernelInputError`.
"""

from __future__ import annotations

import torch

from flowllm.kernels import native

__all__ = ["decode_attention", "serves", "store_kv"]

DTYPES = (torch.float32, torch.bfloat16)
# head_dim in whole 512-bit registers of the cache's dtype (16 float32, 32 bfloat16)
HEAD_DIM_MULTIPLE = {torch.float32: 16, torch.bfloat16: 32}


def serves(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the native kernels run this attention and K/V store: a CPU with the
    library, one dtype they handle for the query and the cache, and a head_dim in whole
    512-bit registers of it (pairs of AVX2 ones)."""
    return (
        query.is_cpu
        and query.dtype in DTYPES
        and k_cache.dtype == query.dtype
        and k_cache.shape[-1] % HEAD_DIM_MULTIPLE[query.dtype] == 0
        and native.library() is not None
    )


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    seqs: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Write into `out` each decode query's attention over its sequence's paged context.

    seqs, rows: the sequences attended and their query rows (mixed prefill/decode steps);
    None attends every sequence i with query row i. window > 0: each query sees only its
    sequence's last `window` positions; softcap > 0: scores become
    softcap * tanh(score / softcap) before the softmax."""
    # query, out: [num_tokens, H, D]; k_cache, v_cache: [num_blocks, block_size, kvh, D]
    # block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32
    # seqs, rows: [n] int64
    native.call(
        torch.ops.flowllm.decode_attention, query, k_cache, v_cache, block_tables, seq_lens,
        seqs, rows, float(scale), int(window), float(softcap), out,
    )  # fmt: skip


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy this step's K/V rows into their cache slots (slot = block * block_size + offset)."""
    # key, value: [n, kvh, D] of the cache's dtype; slot_mapping: [n] int64
    native.call(torch.ops.flowllm.store_kv, key, value, k_cache, v_cache, slot_mapping)
