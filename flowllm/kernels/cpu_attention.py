"""Paged decode attention and the K/V store in C (`csrc/attention.c`), with the checks the
C side relies on.

Why: the torch reference gathers each decode sequence's blocks into a workspace before
attending, and in half precision scores every query head against every kv head (its
block-diagonal product); the kernel reads each K/V row once, where it lies, for the query
heads that share it. float32 and bfloat16 (widened by a shift or a mask: any CPU the
library is built for); the math is float32, bf16 outputs rounded to nearest even.

Index contents (sequence and row indices, lengths, block ids, slots) are checked in C
before anything is read, and raised by the ops; shapes, dtypes and strides here. Both
raise `KernelInputError`.
"""

from __future__ import annotations

import torch

from flowllm.kernels import native
from flowllm.kernels.reference import KernelInputError

__all__ = ["decode_attention", "serves", "store_kv"]

DTYPES = (torch.float32, torch.bfloat16)
# head_dim in whole 512-bit registers of the cache's dtype (16 float32, 32 bfloat16)
HEAD_DIM_MULTIPLE = {torch.float32: 16, torch.bfloat16: 32}


def _available() -> None:
    if native.library() is None:
        raise KernelInputError("the native kernel library is not available on this machine")


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


def _check_rows(name: str, x: torch.Tensor, head_dim: int) -> None:
    """x: [tokens, heads, head_dim] with each token's heads contiguous (any token stride)."""
    if x.dim() != 3 or x.shape[2] != head_dim or x.stride(2) != 1 or x.stride(1) != head_dim:
        raise KernelInputError(
            f"{name} must be [tokens, heads, head_dim={head_dim}] with each token's heads "
            f"contiguous, got shape {tuple(x.shape)} strides {x.stride()}"
        )


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise KernelInputError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]"
            f" of one dtype, got {tuple(k_cache.shape)} {k_cache.dtype} and "
            f"{tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelInputError("k_cache and v_cache must be contiguous")


def _check_index(name: str, x: torch.Tensor, dtype: torch.dtype, dims: int) -> None:
    if x.dtype != dtype or x.dim() != dims or not x.is_contiguous():
        raise KernelInputError(
            f"{name} must be a contiguous {dims}-d {dtype} tensor, got {x.dtype} "
            f"{tuple(x.shape)} strides {x.stride()}"
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
    _available()
    _check_caches(k_cache, v_cache)
    kv_heads, head_dim = k_cache.shape[2:]
    _check_rows("query", query, head_dim)
    _check_rows("out", out, head_dim)
    if query.dtype != k_cache.dtype or out.dtype != query.dtype or query.dtype not in DTYPES:
        raise KernelInputError(
            f"query, caches and out must share one dtype of {list(DTYPES)}, got "
            f"{query.dtype}, {k_cache.dtype}, {out.dtype}"
        )
    multiple = HEAD_DIM_MULTIPLE[query.dtype]
    if head_dim % multiple != 0:
        raise KernelInputError(f"head_dim {head_dim} is not a multiple of {multiple}")
    num_heads = query.shape[1]
    if num_heads % kv_heads != 0 or out.shape != query.shape:
        raise KernelInputError(
            f"query {tuple(query.shape)} and out {tuple(out.shape)} must match, with "
            f"num_heads a multiple of num_kv_heads {kv_heads}"
        )
    _check_index("block_tables", block_tables, torch.int32, 2)
    _check_index("seq_lens", seq_lens, torch.int32, 1)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise KernelInputError(
            f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences"
        )
    if (seqs is None) != (rows is None):
        raise KernelInputError("seqs and rows go together")
    if seqs is not None and rows is not None:
        _check_index("seqs", seqs, torch.int64, 1)
        _check_index("rows", rows, torch.int64, 1)
        if rows.shape != seqs.shape:
            raise KernelInputError(f"seqs {tuple(seqs.shape)} and rows {tuple(rows.shape)}")
    if window < 0 or softcap < 0:
        raise KernelInputError(f"window {window} and softcap {softcap} must not be negative")
    try:
        torch.ops.flowllm.decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, seqs, rows, float(scale),
            int(window), float(softcap), out,
        )  # fmt: skip
    except ValueError as e:  # an index the kernel refused
        raise KernelInputError(str(e)) from None


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy this step's K/V rows into their cache slots (slot = block * block_size + offset)."""
    # key, value: [n, kvh, D] of the cache's dtype; slot_mapping: [n] int64
    _available()
    _check_caches(k_cache, v_cache)
    _check_rows("key", key, k_cache.shape[3])
    _check_rows("value", value, k_cache.shape[3])
    if (
        key.shape != value.shape
        or key.shape[1] != k_cache.shape[2]
        or key.dtype != k_cache.dtype
        or value.dtype != k_cache.dtype
    ):
        raise KernelInputError(
            f"key/value {tuple(key.shape)} {key.dtype} / {tuple(value.shape)} {value.dtype} "
            f"do not match the cache's [num_kv_heads, head_dim] = {tuple(k_cache.shape[2:])} "
            f"{k_cache.dtype}"
        )
    _check_index("slot_mapping", slot_mapping, torch.int64, 1)
    if slot_mapping.shape[0] != key.shape[0]:
        raise KernelInputError(
            f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    try:
        torch.ops.flowllm.store_kv(key, value, k_cache, v_cache, slot_mapping)
    except ValueError as e:  # a slot the kernel refused
        raise KernelInputError(str(e)) from None
