"""Triton kernels for attention over the paged KV cache: KV store, decode, varlen prefill.

The cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim];
a sequence's tokens live in the blocks its block table lists, in order. Token position p of
sequence i is at block ``block_tables[i, p // block_size]``, offset ``p % block_size``.

Kernels gather cache rows token by token through the block table, so a KV tile may span
several cache blocks (any block size works, including ones smaller than a tile or not a power
of two). Grouped-query attention packs the query heads that share one KV head into the rows
of a tile, so each K/V tile is read once per KV head rather than once per query head.
Softmax runs online (FlashAttention style) in fp32 with base-2 exponentials; the scale is
folded into the exponent. A sliding window (`window` > 0: each query sees its last `window`
positions) masks older keys and skips the tiles wholly before it; a softcap caps each score
as softcap * tanh(score / softcap) before the softmax (Gemma 2).

The wrappers validate every argument before launching and raise ValueError naming the
argument: a bad launch on a GPU corrupts memory instead of failing. They never read tensor
values on the host (that would synchronise the device); index values are trusted, except
that store_kv skips slots outside the cache (negative slots mark padding tokens) and the
attention kernels never read past a block table's row.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

__all__ = [
    "AttentionTiles",
    "auto_decode_splits",
    "choose_tiles",
    "interpreted",
    "paged_attention",
    "store_kv",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634
# tl.dot needs every block dimension >= 16 on NVIDIA and AMD tensor cores.
_MIN_DOT = 16
_MAX_DECODE_SPLITS = 32  # a power of two: the reduce kernel's block of splits
# Arguments whose values follow the batch (the block table's width, the decode splits):
# never specialized, so a new batch never compiles a new variant of a kernel while serving.
# Every other integer argument is fixed by the model and the cache.
_BATCH_VARYING = ["max_blocks", "stride_bt", "num_splits"]
_MAX_GRID_YZ = 65535  # CUDA's limit on the second and third grid dimensions


@dataclass(frozen=True)
class AttentionTiles:
    """Tile sizes of the attention kernels (powers of two, each >= 16).

    block_m: rows of a prefill tile; a row is one (query token, query head of the group)
      pair, so a tile covers block_m // group query tokens.
    block_n: cache tokens per KV tile (prefill and decode).
    decode_block_n: cache tokens per KV tile in the decode kernel.
    decode_splits: parallel splits of each context in the decode kernel; 0 chooses from
      the batch and the GPU's SM count (always 1 off CUDA).
    """

    block_m: int = 64
    block_n: int = 64
    decode_block_n: int = 64
    decode_splits: int = 0
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.decode_splits <= _MAX_DECODE_SPLITS:
            raise ValueError(
                f"AttentionTiles.decode_splits must be in [0, {_MAX_DECODE_SPLITS}], "
                f"got {self.decode_splits}"
            )
        for name in ("block_m", "block_n", "decode_block_n"):
            value = getattr(self, name)
            if value < _MIN_DOT or value & (value - 1):
                raise ValueError(f"AttentionTiles.{name} must be a power of two >= 16, got {value}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(
                f"AttentionTiles.num_warps must be a power of two, got {self.num_warps}"
            )
        if self.num_stages < 1:
            raise ValueError(f"AttentionTiles.num_stages must be >= 1, got {self.num_stages}")


def choose_tiles(head_dim: int, dtype: torch.dtype) -> AttentionTiles:
    """Default tiles for one head width and dtype.

    Chosen from sm_80 builds (registers per thread, spills, shared memory) so that no
    kernel spills registers and none needs more than 64 KiB of shared memory (the most an
    sm_75 block may use). fp32 tiles are smaller: fp32 dots run on FMA units (IEEE
    precision, no TF32), which hold whole tiles in registers.
    """
    width = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        side = 32 if width <= 128 else 16
        return AttentionTiles(block_m=side, block_n=side, decode_block_n=side)
    if width <= 64:
        return AttentionTiles(block_m=64, block_n=64, decode_block_n=64)
    if width <= 128:
        return AttentionTiles(block_m=64, block_n=32, decode_block_n=64)
    if width <= 256:
        return AttentionTiles(block_m=32, block_n=32, decode_block_n=32)
    return AttentionTiles(block_m=16, block_n=16, decode_block_n=16)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    num_slots,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per token: copy its [num_kv_heads, head_dim] K and V rows into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # Slots outside the cache (padding tokens) are skipped: no head is in range then.
    num_heads = tl.where((slot >= 0) & (slot < num_slots), NUM_KV_HEADS, 0)
    block = slot // block_size
    offset = slot % block_size

    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (h < num_heads) & (d < HEAD_DIM)  # [BLOCK_H, BLOCK_D]

    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(
        k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d, k, mask=mask
    )
    tl.store(
        v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d, v, mask=mask
    )


@triton.jit
def _attend_kv_tile(
    q,  # [BLOCK_M, BLOCK_D], the query rows of this program, input dtype
    acc,  # [BLOCK_M, BLOCK_D] fp32, unnormalised output
    m_i,  # [BLOCK_M] fp32, running max of the base-2 logits
    l_i,  # [BLOCK_M] fp32, running sum of exp2(logit - m_i)
    q_pos,  # [BLOCK_M] int32, position of each row's query (causal limit)
    start,  # first cache position of this tile
    lo,  # the first position any row may see (0, or the window's start): none before is read
    seq_len,
    table_row_ptr,  # block table row of this sequence
    max_blocks,
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    block_size,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    qk_scale,  # softmax scale * log2(e)
    window,  # > 0: a query at p sees keys p - window < j <= p only
    softcap,  # the score cap * log2(e), when SOFTCAP
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDEN_DOT: tl.constexpr,  # multiply 16-bit tiles as fp32 (see _widen_dot)
    SOFTCAP: tl.constexpr,
):
    """Fold one tile of BLOCK_N cache positions into the online softmax of every row."""
    pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] cache positions
    table_idx = pos // block_size
    pos_ok = (pos >= lo) & (pos < seq_len) & (table_idx < max_blocks)  # [BLOCK_N]
    block = tl.load(table_row_ptr + table_idx, mask=pos_ok, other=0).to(tl.int64)
    within = (pos % block_size).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    kv_mask = pos_ok[:, None] & d_ok[None, :]  # [BLOCK_N, BLOCK_D]

    k_rows = block * stride_kb + within * stride_ks + kv_head * stride_kh  # [BLOCK_N] int64
    k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if WIDEN_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = s * qk_scale  # [BLOCK_M, BLOCK_N] fp32, base-2 logits
    if SOFTCAP:  # c tanh(x / c) on base-2 logits: the cap is in base-2 units too
        e = tl.exp2(s * (2.8853900817779268 / softcap))  # exp(2 x / c): 2 log2(e) s / cap
        # e = inf or 0 gives tanh 1 or -1
        s = softcap * (1.0 - 2.0 / (e + 1.0))
    keep = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])  # causal; q_pos -1: padded row
    keep = keep & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
    s = tl.where(keep, s, float("-inf"))

    # m_i starts finite (-1e30), so rows with every logit masked keep alpha = 1, p = 0.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)

    v_rows = block * stride_vb + within * stride_vs + kv_head * stride_vh
    v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    p = p.to(v.dtype)  # the PV product runs in the cache dtype, accumulating in fp32
    if WIDEN_DOT:
        pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p, v, input_precision="ieee")
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit(do_not_specialize=_BATCH_VARYING)
def _decode_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [num_tokens, num_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks]
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    max_blocks,
    block_size,
    window,
    softcap,
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, HEAD_DIM] fp32, when num_splits > 1
    part_m_ptr,  # [num_seqs, num_heads, num_splits] fp32
    part_l_ptr,  # [num_seqs, num_heads, num_splits] fp32
    num_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= max(16, GROUP): the group's heads, padded for tl.dot
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One program per (sequence, KV head, split): the sequence's single query, for every
    query head of the group, attends to the split's share of the seq_len cached positions
    (the query is the last of them). With one split the program writes the output; with
    several (flash decoding, for batches too small to fill the GPU) it writes its unnormalised
    accumulator and softmax statistics for _decode_reduce_kernel to merge."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # A sequence may have no query this step: then no row is valid and no key is read.
    q_count = tl.minimum(q_end - q_start, 1).to(tl.int32)  # 0 or 1
    kv_end = seq_len * q_count

    m = tl.arange(0, BLOCK_M)  # row m is query head kv_head * GROUP + m
    d = tl.arange(0, BLOCK_D)
    row_ok = m < GROUP * q_count
    head = (kv_head * GROUP + m).to(tl.int64)
    io_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)  # [BLOCK_M, BLOCK_D]
    q = tl.load(
        q_ptr + q_start * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=io_mask,
        other=0.0,
    )
    q_pos = tl.where(row_ok, seq_len - 1, -1)  # [BLOCK_M]; -1 masks padded rows

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_row_ptr = block_tables_ptr + seq * stride_bt
    # The window's first key, and the tile holding it (0 and tile 0 without a window).
    lo = tl.where(window > 0, tl.maximum(kv_end - window, 0), 0)
    kv_first = lo // BLOCK_N * BLOCK_N
    # This split's share: a contiguous run of whole BLOCK_N tiles (possibly none).
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_first, BLOCK_N), num_splits)
    kv_lo = kv_first + split * tiles_per_split * BLOCK_N
    kv_hi = tl.minimum(kv_lo + tiles_per_split * BLOCK_N, kv_end)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        acc, m_i, l_i = _attend_kv_tile(
            q, acc, m_i, l_i, q_pos, start, lo, seq_len, table_row_ptr, max_blocks,
            k_cache_ptr, v_cache_ptr, kv_head, block_size,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
            window, softcap, HEAD_DIM, BLOCK_N, BLOCK_D, WIDEN_DOT, SOFTCAP,
        )  # fmt: skip

    if num_splits == 1:
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + q_start * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )
    else:
        part = (seq * NUM_HEADS + head) * num_splits + split  # [BLOCK_M] int64
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=io_mask)
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)


@triton.jit(do_not_specialize=_BATCH_VARYING)
def _decode_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_start_loc_ptr,  # [num_seqs + 1]
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, HEAD_DIM] fp32
    part_m_ptr,  # [num_seqs, num_heads, num_splits] fp32
    part_l_ptr,  # [num_seqs, num_heads, num_splits] fp32
    stride_ot,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits, a power of two: the most splits there can be
    BLOCK_D: tl.constexpr,
):
    """One program per (sequence, query head): merge the splits' partial softmaxes."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64)
    q_count = tl.minimum(q_end - q_start, 1).to(tl.int32)  # 0: nothing was computed

    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    split_ok = sp < num_splits * q_count  # [BLOCK_S]
    part = (seq * NUM_HEADS + head) * num_splits + sp  # [BLOCK_S]
    # A split that saw no key has m = -1e30 and l = 0, so its weight below is 0.
    m_s = tl.load(part_m_ptr + part, mask=split_ok, other=-1.0e30)
    l_s = tl.load(part_l_ptr + part, mask=split_ok, other=0.0)
    weight = tl.exp2(m_s - tl.max(m_s, axis=0))  # [BLOCK_S]
    acc_mask = split_ok[:, None] & (d[None, :] < HEAD_DIM)
    acc_s = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=acc_mask, other=0.0)
    total = tl.sum(l_s * weight, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(acc_s * weight[:, None], axis=0) / total  # [BLOCK_D]
    tl.store(
        out_ptr + q_start * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM * q_count,
    )


@triton.jit(do_not_specialize=_BATCH_VARYING)
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [num_tokens, num_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks]
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    max_blocks,
    block_size,
    window,
    softcap,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per tile: BLOCK_Q query tokens x GROUP heads, padded
    BLOCK_Q: tl.constexpr,  # query tokens per tile, BLOCK_M // GROUP
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One program per (sequence, tile of BLOCK_Q queries, KV head). Queries are the last
    q_len of the sequence's seq_len positions; each attends causally to the cached prefix and
    to the queries up to itself. Tiles past the sequence's queries do nothing."""
    seq = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len  # cached prefix before this step's queries

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_tok = tile * BLOCK_Q + m // GROUP  # [BLOCK_M] query index within the sequence
    head = (kv_head * GROUP + m % GROUP).to(tl.int64)
    row_ok = (m < BLOCK_Q * GROUP) & (q_tok < q_len)
    io_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)  # [BLOCK_M, BLOCK_D]
    row_off = (q_start + q_tok.to(tl.int64))[:, None]
    q = tl.load(
        q_ptr + row_off * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=io_mask,
        other=0.0,
    )
    q_pos = tl.where(row_ok, context_len + q_tok, -1)  # [BLOCK_M]; -1 masks padded rows

    # The tile's last query sits at context_len + last_tok: no key beyond it is needed.
    last_tok = tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = tl.where(tile * BLOCK_Q < q_len, context_len + last_tok + 1, 0)
    # Under a window, the tile's first query sees nothing before its window's first key.
    lo = tl.where(window > 0, tl.maximum(context_len + tile * BLOCK_Q - window + 1, 0), 0)
    kv_first = lo // BLOCK_N * BLOCK_N

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_row_ptr = block_tables_ptr + seq * stride_bt
    for start in range(kv_first, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_kv_tile(
            q, acc, m_i, l_i, q_pos, start, lo, seq_len, table_row_ptr, max_blocks,
            k_cache_ptr, v_cache_ptr, kv_head, block_size,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
            window, softcap, HEAD_DIM, BLOCK_N, BLOCK_D, WIDEN_DOT, SOFTCAP,
        )  # fmt: skip

    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + row_off * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


# --------------------------------------------------------------------------- host side


def interpreted() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at
    import time): Triton decides when a kernel is decorated, not when it is launched."""
    return not isinstance(_store_kv_kernel, JITFunction)


def _decode_splits(
    tiles: AttentionTiles, device: torch.device, programs: int, max_seq_len: int
) -> int:
    """How many splits of each sequence's context the decode kernel runs in parallel."""
    if tiles.decode_splits:
        return tiles.decode_splits
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return auto_decode_splits(num_sms, programs, max_seq_len, tiles.decode_block_n)


def auto_decode_splits(num_sms: int, programs: int, max_seq_len: int, block_n: int) -> int:
    """Splits for `programs` (sequence, KV head) pairs on a GPU with `num_sms` SMs.

    One program per pair leaves most of a GPU idle for small batches of long sequences;
    splitting the context fills it, at the price of a merge pass. Aim at two programs per
    SM, keep at least four KV tiles per split, and use powers of two. The count is a kernel
    argument, not a compile-time constant: every count runs the same compiled kernels.
    """
    if programs >= num_sms:
        return 1
    want = min(
        triton.cdiv(2 * num_sms, max(programs, 1)),
        triton.cdiv(max_seq_len, block_n) // 4,
        _MAX_DECODE_SPLITS,
    )
    return 1 if want < 2 else 1 << (want.bit_length() - 1)


def _widen_dot(dtype: torch.dtype) -> bool:
    """Triton's interpreter multiplies bfloat16 dot operands as their raw 16-bit patterns, so
    there the tiles are widened to fp32 first. That computes what a GPU computes: bf16
    products are exact in fp32 and the sums accumulate in fp32 either way."""
    return interpreted() and dtype == torch.bfloat16


def _check_tensor(name: str, t: object, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    return t


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def _check_index(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def _check_unit_last_stride(name: str, t: torch.Tensor) -> None:
    """Kernels address the last dimension as contiguous lanes (vectorised loads)."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension, got strides {t.stride()}"
        )


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _check_devices(named: dict[str, torch.Tensor]) -> None:
    """All tensors on one device, and one Triton can run on."""
    first_name, first = next(iter(named.items()))
    device = first.device
    for name, t in named.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {device}")
    if device.type == "cpu":
        if not interpreted():
            raise ValueError(
                f"{first_name} is on the CPU: the Triton kernels run on CPU tensors only under "
                "the interpreter (TRITON_INTERPRET=1 before flowllm is imported); use "
                "flowllm.kernels.reference on CPU"
            )
    elif device.type != "cuda":
        raise ValueError(f"{first_name} is on {device}: the Triton kernels need a CUDA device")


def _launch_device(t: torch.Tensor) -> AbstractContextManager[object]:
    """Launch on the tensors' GPU, not the current one (they differ on multi-GPU hosts)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else nullcontext()


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K and V rows into its cache slot.

    key, value: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: [num_tokens] int64 (or int32); slot = block_id * block_size + offset.
    Slots outside [0, num_blocks * block_size) (e.g. -1 for padding) are skipped.
    """
    key = _check_tensor("key", key, 3)
    value = _check_tensor("value", value, 3)
    k_cache = _check_tensor("k_cache", k_cache, 4)
    v_cache = _check_tensor("v_cache", v_cache, 4)
    slot_mapping = _check_tensor("slot_mapping", slot_mapping, 1)
    _check_float("key", key)
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != key.dtype:
            raise ValueError(f"{name} must have key's dtype {key.dtype}, got {t.dtype}")
    _check_index("slot_mapping", slot_mapping)
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, {num_kv_heads}, {head_dim}] to match key, "
            f"got {tuple(k_cache.shape)}"
        )
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping must have num_tokens={num_tokens} entries, got {slot_mapping.shape[0]}"
        )
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_unit_last_stride(name, t)
    _check_contiguous("slot_mapping", slot_mapping)
    _check_devices(
        {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache,
         "slot_mapping": slot_mapping}
    )  # fmt: skip
    if num_tokens == 0 or k_cache.numel() == 0:
        return

    # One program copies a token's whole [num_kv_heads, head_dim] row of K and of V.
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    with _launch_device(key):
        _store_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            num_blocks * block_size, block_size,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            num_warps=4 if block_h * block_d <= 2048 else 8,  # wide rows: more threads
        )  # fmt: skip


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    tiles: AttentionTiles | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of a flattened batch of queries over the paged KV cache.

    query: [num_tokens, num_heads, head_dim], sequences concatenated in order
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], this step's K/V
      already stored; num_heads is a multiple of num_kv_heads (GQA; MQA; MHA)
    block_tables: [num_seqs, max_blocks_per_seq] int32 (or int64)
    query_start_loc: [num_seqs + 1]; sequence i's queries are rows qsl[i]:qsl[i+1]
    seq_lens: [num_seqs]; tokens of sequence i in the cache, prefix plus this step's queries.
      Query j of q_len is at position seq_len - q_len + j and sees positions <= its own.
    max_query_len, max_seq_len: host-side upper bounds of the above (no device sync).
      max_query_len == 1 (all decodes) runs the decode kernel; anything else the prefill
      kernel, which also handles mixed decode and prefill batches.
    tiles: tile sizes; None picks choose_tiles(head_dim, query.dtype).
    window: > 0, each query sees only its sequence's last `window` positions.
    softcap: > 0, scores become softcap * tanh(score / softcap) before the softmax.
    Returns [num_tokens, num_heads, head_dim] in query's dtype; rows past qsl[-1] are
    unspecified.
    """
    query = _check_tensor("query", query, 3)
    k_cache = _check_tensor("k_cache", k_cache, 4)
    v_cache = _check_tensor("v_cache", v_cache, 4)
    block_tables = _check_tensor("block_tables", block_tables, 2)
    query_start_loc = _check_tensor("query_start_loc", query_start_loc, 1)
    seq_lens = _check_tensor("seq_lens", seq_lens, 1)
    _check_float("query", query)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != query.dtype:
            raise ValueError(f"{name} must have query's dtype {query.dtype}, got {t.dtype}")
    for name, t in (
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
    ):
        _check_index(name, t)

    num_tokens, num_heads, head_dim = query.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} != query head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"query's num_heads={num_heads} must be a multiple of k_cache's "
            f"num_kv_heads={num_kv_heads}"
        )
    num_seqs, max_blocks = block_tables.shape
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries "
            f"(block_tables has {num_seqs} rows), got {query_start_loc.shape[0]}"
        )
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"seq_lens must have num_seqs = {num_seqs} entries, got {seq_lens.shape[0]}"
        )
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"window must be a non-negative int, got {window!r}")
    if (
        not isinstance(softcap, (int, float))
        or isinstance(softcap, bool)
        or not math.isfinite(softcap)
        or softcap < 0
    ):
        raise ValueError(f"softcap must be a finite number >= 0, got {softcap!r}")
    for name, bound in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
            raise ValueError(f"{name} must be a non-negative int, got {bound!r}")
    if max_query_len > max_seq_len:
        raise ValueError(
            f"max_query_len={max_query_len} exceeds max_seq_len={max_seq_len}: queries are "
            "part of their sequence"
        )
    if max_seq_len > max_blocks * block_size:
        raise ValueError(
            f"max_seq_len={max_seq_len} exceeds what block_tables can address "
            f"({max_blocks} blocks x block_size {block_size})"
        )
    if max_query_len > num_tokens:
        raise ValueError(f"max_query_len={max_query_len} exceeds query's {num_tokens} tokens")
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_unit_last_stride(name, t)
    _check_unit_last_stride("block_tables", block_tables)
    _check_contiguous("query_start_loc", query_start_loc)
    _check_contiguous("seq_lens", seq_lens)
    if tiles is None:
        tiles = choose_tiles(head_dim, query.dtype)
    elif not isinstance(tiles, AttentionTiles):
        raise ValueError(f"tiles must be an AttentionTiles, got {type(tiles).__name__}")
    _check_devices(
        {"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
         "query_start_loc": query_start_loc, "seq_lens": seq_lens}
    )  # fmt: skip

    # out: [num_tokens, num_heads, head_dim], contiguous
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0 or num_heads * head_dim == 0:
        return out

    group = num_heads // num_kv_heads
    widen = _widen_dot(query.dtype)
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    common = (
        query, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        float(scale) * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), max_blocks, block_size, window, float(softcap) * _LOG2E,
    )  # fmt: skip
    with _launch_device(query):
        if max_query_len == 1:
            splits = _decode_splits(tiles, query.device, num_seqs * num_kv_heads, max_seq_len)
            if splits > 1:
                # Partial results of each split, merged by _decode_reduce_kernel.
                part_acc = torch.empty(
                    (num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=out.device
                )
                part_m = torch.empty(
                    (num_seqs, num_heads, splits), dtype=torch.float32, device=out.device
                )
                part_l = torch.empty_like(part_m)
            else:  # never touched with one split; float32 as above, for one compiled kernel
                part_acc = part_m = part_l = torch.empty(1, dtype=torch.float32, device=out.device)
            _decode_kernel[(num_seqs, num_kv_heads, splits)](
                *common,
                part_acc,
                part_m,
                part_l,
                splits,
                NUM_HEADS=num_heads,
                GROUP=group,
                HEAD_DIM=head_dim,
                BLOCK_M=max(_MIN_DOT, triton.next_power_of_2(group)),
                BLOCK_N=tiles.decode_block_n,
                BLOCK_D=block_d,
                WIDEN_DOT=widen,
                SOFTCAP=softcap > 0,
                num_warps=tiles.num_warps,
                num_stages=tiles.num_stages,
            )
            if splits > 1:
                _decode_reduce_kernel[(num_seqs, num_heads)](
                    out, query_start_loc, part_acc, part_m, part_l,
                    out.stride(0), out.stride(1), splits,
                    NUM_HEADS=num_heads,
                    HEAD_DIM=head_dim,
                    BLOCK_S=_MAX_DECODE_SPLITS,
                    BLOCK_D=triton.next_power_of_2(head_dim),
                    num_warps=tiles.num_warps,
                )  # fmt: skip
        else:
            block_m = max(tiles.block_m, triton.next_power_of_2(group))
            block_q = block_m // group
            q_tiles = triton.cdiv(max_query_len, block_q)
            if q_tiles > _MAX_GRID_YZ:
                raise ValueError(
                    f"max_query_len={max_query_len} needs {q_tiles} query tiles of {block_q}; "
                    f"a launch allows {_MAX_GRID_YZ}: split the prefill into chunks"
                )
            grid = (num_seqs, q_tiles, num_kv_heads)
            _prefill_kernel[grid](
                *common,
                GROUP=group,
                HEAD_DIM=head_dim,
                BLOCK_M=block_m,
                BLOCK_Q=block_q,
                BLOCK_N=tiles.block_n,
                BLOCK_D=block_d,
                WIDEN_DOT=widen,
                SOFTCAP=softcap > 0,
                num_warps=tiles.num_warps,
                num_stages=tiles.num_stages,
            )
    return out
