"""Torch reference attention over the paged KV cache: the CPU production path and the oracle
the Triton kernels are tested against.

Decode rows (one query per sequence) of a step run together: their cache blocks are
gathered into one padded [B, max_len, kv_heads, head_dim] view and attended with one masked
`scaled_dot_product_attention`. Sequences with several queries (prefill chunks, possibly
after a cached prefix) run one SDPA each over their gathered context with a causal mask
shifted by the prefix length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KernelInputError(ValueError):
    """A kernel argument has the wrong shape or dtype; the message names it."""


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise KernelInputError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]"
            f", got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's K/V rows into their cache slots (slot = block * block_size + offset)."""
    # key, value: [num_tokens, num_kv_heads, head_dim]
    # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    _check_cache(k_cache, v_cache)
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:]:
        raise KernelInputError(
            f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not match the cache's "
            f"[num_kv_heads, head_dim] = {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise KernelInputError(
            f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    slots = slot_mapping.to(torch.int64)
    # Flat views share storage with the caches: [num_blocks * block_size, kv_heads, head_dim].
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """The first `num_blocks` blocks of each row of `block_tables`, as [B, L, kv_heads, D]."""
    if num_blocks > block_tables.shape[1]:
        raise KernelInputError(
            f"a sequence needs {num_blocks} blocks but block_tables has only "
            f"{block_tables.shape[1]} columns"
        )
    blocks = block_tables[:, :num_blocks].to(torch.int64)  # [B, nb]
    gathered = cache.index_select(0, blocks.reshape(-1))  # [B * nb, bs, kv_heads, D]
    return gathered.view(blocks.shape[0], num_blocks * cache.shape[1], *cache.shape[2:])


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
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its paged context (GQA aware)."""
    # query: [num_tokens, num_heads, head_dim]; returns the same shape.
    _check_cache(k_cache, v_cache)
    if query.dim() != 3 or query.shape[2] != k_cache.shape[3]:
        raise KernelInputError(
            f"query must be [num_tokens, num_heads, head_dim={k_cache.shape[3]}], "
            f"got {tuple(query.shape)}"
        )
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise KernelInputError(
            f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise KernelInputError(
            f"query_start_loc {tuple(query_start_loc.shape)} and block_tables "
            f"{tuple(block_tables.shape)} must describe the {num_seqs} sequences of seq_lens"
        )
    block_size = k_cache.shape[1]
    gqa = num_heads != num_kv_heads
    out = torch.empty_like(query)

    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [qsl[i + 1] - qsl[i] for i in range(num_seqs)]
    decode = [i for i in range(num_seqs) if q_lens[i] == 1]
    if decode:
        _decode(query, k_cache, v_cache, block_tables, qsl, lens, decode, scale, gqa, out)
    for i in range(num_seqs):
        q_len = q_lens[i]
        if q_len <= 1:
            continue
        seq_len = lens[i]
        if q_len > seq_len:
            raise KernelInputError(f"sequence {i} has {q_len} queries but seq_len {seq_len}")
        nb = -(-seq_len // block_size)
        k = _gather_context(k_cache, block_tables[i : i + 1], nb)[0, :seq_len]  # [L, kvh, D]
        v = _gather_context(v_cache, block_tables[i : i + 1], nb)[0, :seq_len]
        q = query[qsl[i] : qsl[i + 1]]  # [q_len, H, D]
        if q_len == seq_len:
            mask = None
        else:
            # Query j sits at position prefix + j and sees keys at positions <= its own.
            prefix = seq_len - q_len
            q_pos = torch.arange(prefix, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [H, q_len, D]
            k.transpose(0, 1),  # [kvh, L, D]
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=gqa,
        )  # [H, q_len, D]
        out[qsl[i] : qsl[i + 1]] = o.transpose(0, 1)
    return out


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    qsl: list[int],
    lens: list[int],
    decode: list[int],
    scale: float,
    gqa: bool,
    out: torch.Tensor,
) -> None:
    """All single-query sequences at once over a padded gather of their blocks."""
    device = query.device
    block_size = k_cache.shape[1]
    max_len = max(lens[i] for i in decode)
    nb = -(-max_len // block_size)
    all_decode = len(decode) == len(lens)
    rows = (
        torch.tensor([qsl[i] for i in decode], dtype=torch.int64, device=device)
        if not all_decode
        else None
    )
    tables = block_tables if all_decode else block_tables[rows.new_tensor(decode)]
    k = _gather_context(k_cache, tables, nb)  # [B, L, kvh, D], L = nb * block_size
    v = _gather_context(v_cache, tables, nb)
    q = query if rows is None else query.index_select(0, rows)  # [B, H, D]
    dec_lens = torch.tensor([lens[i] for i in decode], dtype=torch.int64, device=device)
    # Keys past a sequence's length (padding, stale slots) are masked out: [B, 1, 1, L].
    mask = torch.arange(k.shape[1], device=device)[None, :] < dec_lens[:, None]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, kvh, L, D]
    if k.dtype != torch.float32:
        # CPU SDPA is ~2x slower on strided bf16/fp16 K/V than the copy costs (fp32: no gain).
        k, v = k.contiguous(), v.contiguous()
    o = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [B, H, 1, D]
        k,
        v,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=gqa,
    )[:, :, 0, :]  # [B, H, D]
    if rows is None:
        out.copy_(o)
    else:
        out.index_copy_(0, rows, o)
