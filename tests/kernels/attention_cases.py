"""Paged-attention test cases and their float64 oracle, shared by the kernel tests."""

from __future__ import annotations

import torch


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query [H, D] at position q_pos over dense keys/values [L, kvh, D]: the keys
    q_pos - window < j <= q_pos under a window, scores softcap * tanh(s / softcap) under a
    softcap."""
    group = q.shape[0] // k.shape[1]
    first = max(q_pos + 1 - window, 0) if window > 0 else 0
    out = torch.empty_like(q)
    for h in range(q.shape[0]):
        kh = k[first : q_pos + 1, h // group].double()
        vh = v[first : q_pos + 1, h // group].double()
        s = (kh @ q[h].double()) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        out[h] = (torch.softmax(s, dim=0) @ vh).to(q.dtype)
    return out


def make_case(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """query, caches, block tables (block ids in random order), query_start_loc, seq_lens."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, s in enumerate(seq_lens):
        for j in range(-(-s // block_size)):
            tables[i, j] = perm.pop()
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    return query, k_cache, v_cache, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32)


def expected(query, k_cache, v_cache, tables, qsl, seq_lens, scale, window=0, softcap=0.0):
    """Every query of a `make_case` batch by `naive_attention` (float64 sums)."""
    bs = k_cache.shape[1]
    out = torch.empty_like(query)
    for i, s in enumerate(seq_lens.tolist()):
        blocks = tables[i, : -(-s // bs)].long()
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:s]
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:s]
        a, b = qsl[i].item(), qsl[i + 1].item()
        for j in range(a, b):
            pos = s - (b - a) + (j - a)
            out[j] = naive_attention(query[j], k, v, pos, scale, window, softcap)
    return out


def rows_alone(case, scale, attend, **options) -> torch.Tensor:
    """Each query row of a `make_case` batch computed by `attend` (a paged_attention) as the
    only query of a step, a decode row at its own position: what the row gives in any other
    company, through any chunking of its prompt. `options` go to `attend` (window, softcap)."""
    query, k_cache, v_cache, tables, qsl, seq_lens = case
    out = torch.empty_like(query)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for i, s in enumerate(seq_lens.tolist()):
        a, b = qsl[i].item(), qsl[i + 1].item()
        for j in range(a, b):
            length = s - (b - a) + (j - a) + 1
            lens = torch.tensor([length], dtype=torch.int32)
            out[j] = attend(query[j : j + 1], k_cache, v_cache, tables[i : i + 1], one, lens,
                            scale, 1, length, **options)[0]  # fmt: skip
    return out
