"""The Triton paged-attention kernels against a dense float64 oracle and the torch reference.

On a machine without a GPU the kernels run in Triton's interpreter: set TRITON_INTERPRET=1
(the project's test command does). Without it and without CUDA, the kernel tests skip; the
test that CPU tensors are refused outside the interpreter runs either way.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import triton

from flowllm.kernels import triton_attention as ta

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
needs_backend = pytest.mark.skipif(
    not (HAS_CUDA or ta.interpreted()),
    reason="no CUDA device and TRITON_INTERPRET=1 was not set before import",
)

# Small tiles make short test sequences cross several query and KV tiles.
SMALL_TILES = ta.AttentionTiles(block_m=16, block_n=16, decode_block_n=16)
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 2.5e-2, "rtol": 2.5e-2},
}
HEADS = [(4, 2), (4, 1), (4, 4)]  # (num_heads, num_kv_heads): GQA, MQA, MHA
# (block_size, num_heads, num_kv_heads, dtype): every block size with every head layout in
# fp32, and each block size and head layout once in bf16 (the interpreter is slow).
LAYOUTS = [(bs, h, kv, torch.float32) for bs in (8, 16, 32) for h, kv in HEADS] + [
    (8, 4, 2, torch.bfloat16),
    (16, 4, 4, torch.bfloat16),
    (32, 4, 1, torch.bfloat16),
]
LAYOUT_IDS = [f"bs{bs}-h{h}-kv{kv}-{str(dt)[6:]}" for bs, h, kv, dt in LAYOUTS]


def _reference_module() -> Any | None:
    """flowllm.kernels.reference if it exists and implements both functions."""
    try:
        module = importlib.import_module("flowllm.kernels.reference")
    except ImportError:
        return None
    if not (hasattr(module, "store_kv") and hasattr(module, "paged_attention")):
        return None
    return module


REFERENCE = _reference_module()
needs_reference = pytest.mark.skipif(
    REFERENCE is None, reason="flowllm.kernels.reference is not available yet"
)


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One batch: sequences with a cached prefix and this step's queries, in a paged cache."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    seq_lens: torch.Tensor  # [num_seqs]
    scale: float
    max_query_len: int
    max_seq_len: int

    def args(self) -> tuple[Any, ...]:
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
            self.max_query_len,
            self.max_seq_len,
        )


def make_case(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int32,
    poison: bool = True,
    seed: int = 0,
) -> Case:
    """seqs: (cached prefix length, query count) per sequence.

    Blocks are handed out in a shuffled order. With poison, every cache slot that no
    sequence owns holds NaN and unused block-table entries are -1, so a kernel that reads
    past a sequence's tokens or through a padding entry returns NaN or faults. Without
    poison (the reference gathers whole blocks and needs valid ids), they are finite noise.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [prefix + q_len for prefix, q_len in seqs]
    needed = [-(-length // block_size) for length in seq_lens]
    max_blocks = max(needed) + 1
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    spare = int(perm[-1])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if poison:
        k_cache = torch.full(shape, float("nan"))
        v_cache = torch.full(shape, float("nan"))
        table = torch.full((len(seqs), max_blocks), -1, dtype=torch.int64)
    else:
        k_cache = torch.randn(shape, generator=gen)
        v_cache = torch.randn(shape, generator=gen)
        table = torch.full((len(seqs), max_blocks), spare, dtype=torch.int64)
    used = 0
    for i, length in enumerate(seq_lens):
        blocks = perm[used : used + needed[i]]
        used += needed[i]
        table[i, : needed[i]] = blocks
        pos = torch.arange(length)
        slots_b, slots_o = blocks[pos // block_size], pos % block_size
        k_cache[slots_b, slots_o] = torch.randn(length, num_kv_heads, head_dim, generator=gen)
        v_cache[slots_b, slots_o] = torch.randn(length, num_kv_heads, head_dim, generator=gen)
    q_lens = [q_len for _, q_len in seqs]
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    query = torch.randn(qsl[-1], num_heads, head_dim, generator=gen)
    return Case(
        query=query.to(dtype).to(DEVICE),
        k_cache=k_cache.to(dtype).to(DEVICE),
        v_cache=v_cache.to(dtype).to(DEVICE),
        block_tables=table.to(index_dtype).to(DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=index_dtype, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=index_dtype, device=DEVICE),
        scale=head_dim**-0.5,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def dense_oracle(case: Case, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Gather each sequence's K/V through its block table; causal softmax in float64 (the
    last `window` positions only under a window, scores capped under a softcap)."""
    block_size = case.k_cache.shape[1]
    num_heads, num_kv_heads = case.query.shape[1], case.k_cache.shape[2]
    group = num_heads // num_kv_heads
    qsl = case.query_start_loc.tolist()
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    for i, seq_len in enumerate(case.seq_lens.tolist()):
        q = case.query[qsl[i] : qsl[i + 1]].double().cpu()  # [q_len, H, D]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        pos = torch.arange(seq_len)
        blocks = case.block_tables[i].long().cpu()[pos // block_size]
        k = case.k_cache.cpu()[blocks, pos % block_size].double()  # [L, kvh, D]
        v = case.v_cache.cpu()[blocks, pos % block_size].double()
        if window:  # keys before every window may hold NaN; their weight is 0 here
            k, v = k.nan_to_num(), v.nan_to_num()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]: head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale  # [H, q_len, L]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = seq_len - q_len + torch.arange(q_len)
        hidden = pos[None, None, :] > q_pos[None, :, None]
        if window:
            hidden |= pos[None, None, :] <= q_pos[None, :, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[qsl[i] : qsl[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), **TOLERANCES[dtype])


# ----------------------------------------------------------------------------- attention


@needs_backend
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "dtype"), LAYOUTS, ids=LAYOUT_IDS
)
def test_decode_matches_oracle(
    block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    """One query per sequence, at the end of contexts of odd lengths."""
    case = make_case(
        [(0, 1), (6, 1), (16, 1), (32, 1), (69, 1)],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
        seed=block_size + num_kv_heads,
    )
    assert case.max_query_len == 1
    out = ta.paged_attention(*case.args(), tiles=SMALL_TILES)
    assert out.shape == case.query.shape
    assert_close(out, dense_oracle(case), dtype)


@needs_backend
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "dtype"), LAYOUTS, ids=LAYOUT_IDS
)
def test_prefill_matches_oracle(
    block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    """A mixed batch: fresh prompts, chunks after cached prefixes, and decodes."""
    seqs = [(0, 7), (0, 1), (10, 7), (40, 1), (16, 17), (5, 33)]
    case = make_case(
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
        seed=100 + block_size + num_kv_heads,
    )
    out = ta.paged_attention(*case.args(), tiles=SMALL_TILES)
    assert_close(out, dense_oracle(case), dtype)


@needs_backend
@pytest.mark.parametrize("splits", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_decode_matches_oracle(splits: int, dtype: torch.dtype) -> None:
    """Flash decoding: contexts split over programs and merged. Some splits get no tile
    (short contexts), and one sequence has no query at all."""
    case = make_case([(0, 1), (20, 1), (49, 1), (70, 1)], dtype=dtype, block_size=8, seed=splits)
    qsl = case.query_start_loc.tolist()
    idle = replace(
        case,
        block_tables=case.block_tables[[0, 1, 1, 2, 3]],
        query_start_loc=torch.tensor(qsl[:2] + qsl[1:], device=DEVICE).int(),
        seq_lens=case.seq_lens[[0, 1, 1, 2, 3]],
    )
    tiles = replace(SMALL_TILES, decode_splits=splits)
    out = ta.paged_attention(*idle.args(), tiles=tiles)
    assert_close(out, dense_oracle(case), dtype)


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(10, 0.0), (1, 0.0), (0, 1.5), (23, 2.0)])
@pytest.mark.parametrize("splits", [1, 3])
def test_window_and_softcap_match_oracle(
    window: int, softcap: float, splits: int, dtype: torch.dtype
) -> None:
    """A sliding window and a score cap, on decodes (split or not) and on a mixed batch of
    prefill chunks: the keys before any query's window hold NaN, so a kernel that reads one
    fails."""
    tiles = replace(SMALL_TILES, decode_splits=splits)
    for seqs in ([(0, 1), (20, 1), (49, 1), (70, 1)], [(0, 7), (10, 17), (40, 1), (5, 33)]):
        case = make_case(seqs, dtype=dtype, block_size=8, seed=window + splits)
        if window:
            k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
            for i, (prefix, _) in enumerate(seqs):
                hidden = torch.arange(max(prefix + 1 - window, 0))  # before the first window
                blocks = case.block_tables[i].long()[hidden // 8]
                k_cache[blocks, hidden % 8] = float("nan")
                v_cache[blocks, hidden % 8] = float("nan")
            case = replace(case, k_cache=k_cache, v_cache=v_cache)
        out = ta.paged_attention(*case.args(), tiles=tiles, window=window, softcap=softcap)
        assert_close(out, dense_oracle(case, window, softcap), dtype)


def test_auto_decode_splits() -> None:
    # Enough (sequence, KV head) programs to fill the GPU: no split.
    assert ta.auto_decode_splits(num_sms=108, programs=256, max_seq_len=4096, block_n=64) == 1
    # One sequence, 8 KV heads, long context: 2 * 108 / 8 = 27 -> 16 (a power of two).
    assert ta.auto_decode_splits(num_sms=108, programs=8, max_seq_len=8192, block_n=64) == 16
    # Short context: at least four tiles per split (512 / 64 / 4 = 2).
    assert ta.auto_decode_splits(num_sms=108, programs=8, max_seq_len=512, block_n=64) == 2
    assert ta.auto_decode_splits(num_sms=108, programs=8, max_seq_len=100, block_n=64) == 1
    # Never more than 32.
    assert ta.auto_decode_splits(num_sms=1000, programs=1, max_seq_len=10**6, block_n=16) == 32


@needs_backend
@pytest.mark.parametrize(
    "seqs",
    [[(0, 1), (7, 1), (100, 1)], [(0, 33), (90, 7), (3, 1)]],
    ids=["decode", "mixed"],
)
def test_default_tiles(seqs: list[tuple[int, int]]) -> None:
    """The tiles paged_attention picks itself, with contexts longer than one 64-token tile."""
    case = make_case(seqs, num_heads=4, num_kv_heads=2, block_size=16, seed=7)
    assert_close(ta.paged_attention(*case.args()), dense_oracle(case), torch.float32)


@needs_backend
@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads"),
    [(8, 4, 2), (20, 4, 2), (16, 32, 1), (16, 6, 2)],
    ids=["head_dim_8", "head_dim_20", "group_32", "group_3"],
)
@pytest.mark.parametrize("seqs", [[(0, 1), (21, 1)], [(0, 9), (12, 5), (30, 1)]])
def test_odd_shapes(
    head_dim: int, num_heads: int, num_kv_heads: int, seqs: list[tuple[int, int]]
) -> None:
    """Head dims below 16 and not a power of two; groups wider than a tile or not a power
    of two."""
    case = make_case(
        seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=8
    )
    out = ta.paged_attention(*case.args(), tiles=SMALL_TILES)
    assert_close(out, dense_oracle(case), torch.float32)


@needs_backend
@pytest.mark.parametrize("block_size", [5, 1])
def test_block_size_not_power_of_two(block_size: int) -> None:
    """Tiles gather rows through the block table, so any block size works."""
    case = make_case([(0, 6), (11, 3), (12, 1)], block_size=block_size, seed=3)
    out = ta.paged_attention(*case.args(), tiles=SMALL_TILES)
    assert_close(out, dense_oracle(case), torch.float32)


@needs_backend
@pytest.mark.parametrize("max_query_len", [1, 4])
def test_fp16_and_int64_indices(max_query_len: int) -> None:
    seqs = [(3, 1), (0, max_query_len), (19, 1)]
    case = make_case(seqs, dtype=torch.float16, index_dtype=torch.int64, seed=11)
    out = ta.paged_attention(*case.args(), tiles=SMALL_TILES)
    assert_close(out, dense_oracle(case), torch.float16)


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same cache stored as [num_blocks, num_kv_heads, block_size, head_dim], viewed back
    as [num_blocks, block_size, num_kv_heads, head_dim] (not contiguous)."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


@needs_backend
@pytest.mark.parametrize("max_query_len", [1, 3])
def test_strided_views(max_query_len: int) -> None:
    """query sliced out of a fused QKV tensor; block_tables a slice of a wider table; caches
    stored head-major."""
    case = make_case([(0, max_query_len), (9, 3 if max_query_len > 1 else 1), (17, 1)], seed=5)
    num_tokens, num_heads, head_dim = case.query.shape
    qkv = torch.randn(num_tokens, 3 * num_heads, head_dim, device=DEVICE)
    qkv[:, :num_heads] = case.query
    wide = torch.full((case.block_tables.shape[0], 11), -1, dtype=torch.int32, device=DEVICE)
    wide[:, : case.block_tables.shape[1]] = case.block_tables
    strided = replace(
        case,
        query=qkv[:, :num_heads],
        block_tables=wide[:, :-2],
        k_cache=_head_major(case.k_cache),
        v_cache=_head_major(case.v_cache),
    )
    assert not strided.query.is_contiguous() and not strided.block_tables.is_contiguous()
    assert not strided.k_cache.is_contiguous()
    out = ta.paged_attention(*strided.args(), tiles=SMALL_TILES)
    assert out.is_contiguous()
    assert_close(out, dense_oracle(case), torch.float32)


@needs_backend
@pytest.mark.parametrize("max_query_len", [1, 3])
def test_sequence_without_queries(max_query_len: int) -> None:
    """A sequence with no query rows this step (equal start offsets) is skipped."""
    case = make_case([(4, 1), (0, max_query_len)], seed=9)
    qsl = case.query_start_loc.tolist()
    # Insert an idle sequence between the two: its block table row repeats the first's.
    skipped = replace(
        case,
        block_tables=case.block_tables[[0, 0, 1]],
        query_start_loc=torch.tensor([qsl[0], qsl[1], qsl[1], qsl[2]], device=DEVICE).int(),
        seq_lens=case.seq_lens[[0, 0, 1]],
    )
    out = ta.paged_attention(*skipped.args(), tiles=SMALL_TILES)
    assert_close(out, dense_oracle(case), torch.float32)


@needs_backend
def test_empty_batch() -> None:
    case = make_case([(3, 1)])
    empty = replace(
        case,
        query=case.query[:0],
        block_tables=case.block_tables[:0],
        query_start_loc=case.query_start_loc[:1],
        seq_lens=case.seq_lens[:0],
        max_query_len=0,
        max_seq_len=0,
    )
    assert ta.paged_attention(*empty.args()).shape == (0, *case.query.shape[1:])


# ----------------------------------------------------------------------------- store_kv


def _kv_rows(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_tokens, num_kv_heads, head_dim)
    key = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return key, value


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), [(8, 2, 16), (16, 3, 20)])
def test_store_kv_writes_exactly_its_slots(
    dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    num_blocks, num_tokens = 6, 13
    key, value = _kv_rows(num_tokens, num_kv_heads, head_dim, dtype, seed=block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 7.0, dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, -7.0, dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(-1, num_kv_heads, head_dim)[slots] = key
    expected_v.view(-1, num_kv_heads, head_dim)[slots] = value

    ta.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@needs_backend
def test_store_kv_strided_inputs_and_padding_slots() -> None:
    """key/value sliced out of a fused QKV tensor; int32 slots; slot -1 and slots past the
    cache (padding tokens) write nothing."""
    num_blocks, block_size, num_kv_heads, head_dim = 4, 8, 2, 16
    qkv = torch.randn(6, 3 * num_kv_heads, head_dim, device=DEVICE)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    assert not key.is_contiguous()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, device=DEVICE)
    v_cache = torch.zeros(shape, device=DEVICE)
    slots = torch.tensor([31, -1, 0, 9, num_blocks * block_size, 17], dtype=torch.int32)
    ta.store_kv(key, value, k_cache, v_cache, slots.to(DEVICE))

    expected_k = torch.zeros(num_blocks * block_size, num_kv_heads, head_dim)
    expected_v = torch.zeros_like(expected_k)
    keep = [0, 2, 3, 5]
    expected_k[slots[keep].long()] = key.cpu()[keep]
    expected_v[slots[keep].long()] = value.cpu()[keep]
    assert torch.equal(k_cache.cpu().view_as(expected_k), expected_k)
    assert torch.equal(v_cache.cpu().view_as(expected_v), expected_v)


@needs_backend
def test_store_kv_into_head_major_cache() -> None:
    key, value = _kv_rows(5, 2, 16, torch.float32, seed=8)
    k_cache = _head_major(torch.zeros(3, 8, 2, 16, device=DEVICE))
    v_cache = _head_major(torch.zeros(3, 8, 2, 16, device=DEVICE))
    slots = torch.tensor([3, 8, 23, 12, 0], device=DEVICE)
    ta.store_kv(key, value, k_cache, v_cache, slots)
    blocks, offsets = slots // 8, slots % 8
    assert torch.equal(k_cache[blocks, offsets], key)
    assert torch.equal(v_cache[blocks, offsets], value)
    assert int((k_cache != 0).sum()) == key.numel()


@needs_backend
def test_store_then_attend() -> None:
    """A prefill chunk after a cached prefix, written with store_kv and read back."""
    case = make_case([(9, 6), (0, 5)], block_size=8, seed=21)
    block_size = case.k_cache.shape[1]
    k_new, v_new = _kv_rows(case.query.shape[0], case.k_cache.shape[2], 16, torch.float32, 4)
    slots = []
    for i, (seq_len, q_len) in enumerate(zip(case.seq_lens.tolist(), [6, 5], strict=True)):
        for p in range(seq_len - q_len, seq_len):
            slots.append(int(case.block_tables[i, p // block_size]) * block_size + p % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    ta.store_kv(k_new, v_new, case.k_cache, case.v_cache, slot_mapping)
    assert torch.equal(case.k_cache.view(-1, 2, 16)[slot_mapping], k_new)
    out = ta.paged_attention(*case.args(), tiles=SMALL_TILES)
    assert_close(out, dense_oracle(case), torch.float32)


# ----------------------------------------------------------------------------- reference


@needs_backend
@needs_reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seqs",
    [[(0, 1), (13, 1), (47, 1)], [(0, 12), (20, 9), (33, 1), (0, 1)]],
    ids=["decode", "mixed"],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 4)])
def test_matches_reference(
    seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    case = make_case(
        seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype, block_size=8,
        poison=False, seed=31,
    )  # fmt: skip
    expected = REFERENCE.paged_attention(*case.args())
    out = ta.paged_attention(*case.args(), tiles=SMALL_TILES)
    assert_close(out, expected.to(dtype), dtype)


@needs_backend
@needs_reference
def test_store_kv_matches_reference() -> None:
    key, value = _kv_rows(9, 2, 16, torch.bfloat16, seed=2)
    shape = (5, 8, 2, 16)
    caches = [torch.randn(shape).to(torch.bfloat16).to(DEVICE) for _ in range(2)]
    mine = [c.clone() for c in caches]
    slots = torch.randperm(40)[:9].to(DEVICE)
    REFERENCE.store_kv(key, value, caches[0], caches[1], slots)
    ta.store_kv(key, value, mine[0], mine[1], slots)
    assert torch.equal(mine[0], caches[0]) and torch.equal(mine[1], caches[1])


# ----------------------------------------------------------------------------- input checks


def _attention_inputs() -> dict[str, Any]:
    case = make_case([(2, 3), (5, 1)], block_size=8)
    return dict(zip(
        ["query", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens",
         "scale", "max_query_len", "max_seq_len"],
        case.args(),
        strict=True,
    ))  # fmt: skip


ATTENTION_BREAKAGES = {
    "query_rank": (lambda a: {"query": a["query"][0]}, "query"),
    "query_int": (lambda a: {"query": a["query"].int()}, "query"),
    "query_float64": (lambda a: {"query": a["query"].double()}, "query"),
    "query_not_tensor": (lambda a: {"query": a["query"].tolist()}, "query"),
    "query_last_stride": (
        lambda a: {"query": a["query"].transpose(1, 2).contiguous().transpose(1, 2)},
        "query",
    ),
    "cache_dtype": (lambda a: {"k_cache": a["k_cache"].half()}, "k_cache"),
    "cache_shapes": (lambda a: {"v_cache": a["v_cache"][:-1]}, "v_cache"),
    "head_dim": (lambda a: {"query": a["query"][..., :8]}, "head_dim"),
    "heads_not_multiple": (lambda a: {"query": a["query"][:, :3]}, "num_heads"),
    "tables_float": (lambda a: {"block_tables": a["block_tables"].float()}, "block_tables"),
    "tables_rank": (lambda a: {"block_tables": a["block_tables"][0]}, "block_tables"),
    "qsl_length": (lambda a: {"query_start_loc": a["query_start_loc"][:-1]}, "query_start_loc"),
    "qsl_strided": (
        lambda a: {"query_start_loc": a["query_start_loc"].repeat_interleave(2)[::2]},
        "query_start_loc",
    ),
    "seq_lens_dtype": (lambda a: {"seq_lens": a["seq_lens"].to(torch.int16)}, "seq_lens"),
    "seq_lens_length": (lambda a: {"seq_lens": a["seq_lens"][:1]}, "seq_lens"),
    "scale_nan": (lambda a: {"scale": float("nan")}, "scale"),
    "max_query_len_negative": (lambda a: {"max_query_len": -1}, "max_query_len"),
    "max_seq_len_float": (lambda a: {"max_seq_len": 8.0}, "max_seq_len"),
    "max_query_over_seq": (lambda a: {"max_query_len": 9, "max_seq_len": 8}, "max_query_len"),
    "max_seq_past_table": (lambda a: {"max_seq_len": 10_000}, "max_seq_len"),
    "device_mismatch": (lambda a: {"seq_lens": a["seq_lens"].to("meta")}, "seq_lens"),
}


@pytest.mark.parametrize("breakage", list(ATTENTION_BREAKAGES), ids=list(ATTENTION_BREAKAGES))
def test_paged_attention_rejects_bad_inputs(breakage: str) -> None:
    change, name = ATTENTION_BREAKAGES[breakage]
    args = _attention_inputs()
    args.update(change(args))
    with pytest.raises(ValueError, match=name):
        ta.paged_attention(**args)


def test_paged_attention_rejects_bad_tiles() -> None:
    with pytest.raises(ValueError, match="block_n"):
        ta.AttentionTiles(block_n=8)
    with pytest.raises(ValueError, match="decode_splits"):
        ta.AttentionTiles(decode_splits=33)
    with pytest.raises(ValueError, match="tiles"):
        ta.paged_attention(**_attention_inputs(), tiles=(16, 16))  # type: ignore[arg-type]


def _store_inputs() -> dict[str, Any]:
    key, value = _kv_rows(4, 2, 16, torch.float32, seed=0)
    return {
        "key": key,
        "value": value,
        "k_cache": torch.zeros(3, 8, 2, 16, device=DEVICE),
        "v_cache": torch.zeros(3, 8, 2, 16, device=DEVICE),
        "slot_mapping": torch.arange(4, device=DEVICE),
    }


STORE_BREAKAGES = {
    "key_rank": (lambda a: {"key": a["key"][0]}, "key"),
    "key_float64": (lambda a: {"key": a["key"].double()}, "key"),
    "value_dtype": (lambda a: {"value": a["value"].half()}, "value"),
    "value_shape": (lambda a: {"value": a["value"][:3]}, "value"),
    "cache_dtype": (lambda a: {"v_cache": a["v_cache"].bfloat16()}, "v_cache"),
    "cache_shape": (
        lambda a: {"k_cache": a["k_cache"][..., :8], "v_cache": a["v_cache"][..., :8]},
        "k_cache",
    ),
    "caches_differ": (lambda a: {"v_cache": a["v_cache"][:2]}, "v_cache"),
    "slots_float": (lambda a: {"slot_mapping": a["slot_mapping"].float()}, "slot_mapping"),
    "slots_length": (lambda a: {"slot_mapping": a["slot_mapping"][:3]}, "slot_mapping"),
    "slots_strided": (
        lambda a: {"slot_mapping": torch.arange(8, device=DEVICE)[::2]},
        "slot_mapping",
    ),
    "cache_last_stride": (
        lambda a: {"k_cache": a["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)},
        "k_cache",
    ),
    "device_mismatch": (lambda a: {"slot_mapping": a["slot_mapping"].to("meta")}, "slot_mapping"),
}


@pytest.mark.parametrize("breakage", list(STORE_BREAKAGES), ids=list(STORE_BREAKAGES))
def test_store_kv_rejects_bad_inputs(breakage: str) -> None:
    change, name = STORE_BREAKAGES[breakage]
    args = _store_inputs()
    args.update(change(args))
    with pytest.raises(ValueError, match=name):
        ta.store_kv(**args)


# ----------------------------------------------------------------------------- CPU rules


@pytest.mark.skipif(not ta.interpreted(), reason="TRITON_INTERPRET=1 was not set before import")
def test_cpu_tensors_run_under_interpreter() -> None:
    case = make_case([(4, 3), (9, 1)], block_size=8)
    cpu = replace(
        case,
        **{f: getattr(case, f).cpu() for f in
           ("query", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens")},
    )  # fmt: skip
    assert_close(ta.paged_attention(*cpu.args()), dense_oracle(case), torch.float32)
    key, value = _kv_rows(2, 2, 16, torch.float32, seed=1)
    k_cache, v_cache = cpu.k_cache.clone(), cpu.v_cache.clone()
    ta.store_kv(key.cpu(), value.cpu(), k_cache, v_cache, torch.tensor([0, 5]))
    assert torch.equal(k_cache.view(-1, 2, 16)[[0, 5]], key.cpu())


def test_cpu_tensors_refused_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the interpreter, CPU tensors get a clear ValueError, not a Triton crash."""
    monkeypatch.setattr(ta, "interpreted", lambda: False)
    store = {k: v.cpu() for k, v in _store_inputs().items()}
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ta.store_kv(**store)
    attention = {k: v.cpu() if isinstance(v, torch.Tensor) else v
                 for k, v in _attention_inputs().items()}  # fmt: skip
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ta.paged_attention(**attention)


def test_interpreted_follows_triton() -> None:
    """interpreted() reports the mode Triton built the kernels in (fixed at import)."""
    assert ta.interpreted() == bool(triton.knobs.runtime.interpret)


# ----------------------------------------------------------------------------- specialization


def _compile_key(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The key under which Triton's JIT compiles a launch of `kernel` (the specialization
    its binder derives from the arguments, and the launch options), computed from the
    Python function the interpreter runs and the kernel's own do_not_specialize."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = JITFunction(kernel.fn, do_not_specialize=kernel.kwargs["do_not_specialize"])
    bind = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    _, specialization, options = bind(*args, **kwargs)
    return str(specialization) + str(sorted(options.items()))


@pytest.mark.skipif(not ta.interpreted(), reason="reads the interpreter's kernels")
def test_new_batches_compile_no_new_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode and prefill batches of 1 to 17 sequences, contexts giving block tables 1 to 32
    wide (widths of 1, multiples of 16 and neither: what Triton specializes an integer
    on), 1 to 4 decode splits, 3 to 51 stored tokens: each kernel's launches share one
    compile key per dtype, so no batch compiles a kernel while serving. The launches are
    recorded, not run."""
    kernels = {
        "store_kv": ta._store_kv_kernel,
        "decode": ta._decode_kernel,
        "reduce": ta._decode_reduce_kernel,
        "prefill": ta._prefill_kernel,
    }
    keys: dict[str, set[str]] = {name: set() for name in kernels}
    for name, kernel in kernels.items():

        def record(*args: Any, grid: Any, warmup: bool, _name: str = name, **kwargs: Any) -> None:
            keys[_name].add(_compile_key(kernels[_name], args, kwargs))

        monkeypatch.setattr(kernel, "run", record)

    dtypes = (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        for num_seqs in (1, 2, 3, 16, 17):
            for context, width in {1: 1, 2: 2, 112: 16, 120: 17, 240: 32}.items():
                for q_len in (1, 5):
                    seqs = [(context, q_len)] * num_seqs
                    case = make_case(seqs, block_size=8, dtype=dtype, seed=num_seqs)
                    table = case.block_tables[:, :width].contiguous()  # the widest needed
                    assert table.shape[1] == width
                    case = replace(case, block_tables=table)
                    for splits in (1, 2, 4):
                        tiles = replace(SMALL_TILES, decode_splits=splits)
                        ta.paged_attention(*case.args(), tiles=tiles)
            rows = torch.zeros(num_seqs * 3, 2, 16, dtype=dtype, device=DEVICE)
            cache = torch.zeros(8, 8, 2, 16, dtype=dtype, device=DEVICE)
            slots = torch.arange(num_seqs * 3, device=DEVICE) % 64
            ta.store_kv(rows, rows, cache, cache, slots)
    found = {name: len(k) for name, k in keys.items()}
    assert found == dict.fromkeys(kernels, len(dtypes))


# ----------------------------------------------------------------------------- GPU compile

# Compiles the kernels for an sm_80 GPU down to cubins, with no GPU present, the way a launch
# would (pointers and head-dim strides specialised as multiples of 16): proof that the
# kernels use no interpreter-only construct, and a check of the default tiles' shared memory
# and register spills. It runs in a child process because under TRITON_INTERPRET=1 this
# process only has the interpreter's versions of the kernels.
COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, subprocess, tempfile
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from flowllm.kernels import triton_attention as ta

    TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
    GROUP, NUM_HEADS = 4, 32

    def build(fn, dtype, tiles, constexprs):
        pointers = {
            name: "*" + TYPES[dtype] for name in
            ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "key_ptr", "value_ptr")
        }
        pointers.update(
            block_tables_ptr="*i32", query_start_loc_ptr="*i32", seq_lens_ptr="*i32",
            slot_mapping_ptr="*i64", part_acc_ptr="*fp32", part_m_ptr="*fp32",
            part_l_ptr="*fp32",
        )
        signature, attrs = {}, {}
        for index, name in enumerate(fn.arg_names):
            if name in constexprs:
                signature[name] = "constexpr"
                continue
            signature[name] = pointers.get(name, "fp32" if name == "qk_scale" else "i32")
            if name.endswith("_ptr") or (name.startswith("stride_") and name != "stride_bt"):
                attrs[(index,)] = [["tt.divisibility", 16]]
        source = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
        options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
        compiled = triton.compile(source, target=GPUTarget("cuda", 80, 32), options=options)
        tool = triton.knobs.nvidia.cuobjdump.path
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run(
                [tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                check=True,
            ).stdout
        fields = dict(f.split(":", 1) for f in usage.split() if f.startswith(("REG:", "STACK:")))
        return {"shared": compiled.metadata.shared, "regs": int(fields["REG"]),
                "stack": int(fields["STACK"])}

    report = {}
    for dtype, head_dim, kernels in (
        (torch.bfloat16, 128, ("store_kv", "decode", "reduce", "prefill")),
        (torch.float32, 64, ("prefill",)),
    ):
        tiles = ta.choose_tiles(head_dim, dtype)
        common = dict(GROUP=GROUP, HEAD_DIM=head_dim, BLOCK_D=head_dim, WIDEN_DOT=False)
        decode = dict(common, NUM_HEADS=NUM_HEADS, BLOCK_M=16, BLOCK_N=tiles.decode_block_n)
        variants = {
            "store_kv": (ta._store_kv_kernel, dict(
                NUM_KV_HEADS=NUM_HEADS // GROUP, HEAD_DIM=head_dim, BLOCK_H=8,
                BLOCK_D=head_dim)),
            "decode": (ta._decode_kernel, decode),
            "reduce": (ta._decode_reduce_kernel, dict(
                NUM_HEADS=NUM_HEADS, HEAD_DIM=head_dim, BLOCK_S=ta._MAX_DECODE_SPLITS,
                BLOCK_D=head_dim)),
            "prefill": (ta._prefill_kernel, dict(
                common, BLOCK_M=tiles.block_m, BLOCK_Q=tiles.block_m // GROUP,
                BLOCK_N=tiles.block_n)),
        }
        for kernel in kernels:
            fn, constexprs = variants[kernel]
            report[f"{kernel}-{TYPES[dtype]}-{head_dim}"] = build(fn, dtype, tiles, constexprs)
    print(json.dumps(report))
    """
)


def test_kernels_compile_for_cuda() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 5, report
    for name, usage in report.items():
        # 64 KiB: the most shared memory a block may use on the smallest CUDA GPUs (sm_75).
        assert usage["shared"] <= 64 * 1024, (name, usage)
        assert usage["stack"] == 0, f"{name} spills registers: {usage}"
