"""Torch reference attention over the paged KV cache: the oracle the native and Triton
kernels are tested against, and the CPU path wherever the native library does not serve
(`FLOWLLM_NATIVE_KERNELS=0`, no AVX2, float16, other head sizes).

Every query row attends on its own, over exactly the keys at or before its position (the
last `window` of them under a sliding window) (`_attend_row`), whether it is a decode row
or one of a prefill chunk's: its result then depends only on its sequence's tokens, never
on the other sequences of the step (no padding to their lengths), on how its prompt was
chunked or on a recompute after preemption, which batched products (padded decode
batches, a chunk's causal mask) made it depend on through their reduction orders. Each
sequence's cache blocks are gathered once per call (into a `Workspace` buffer when one is
given).
"""

from __future__ import annotations

import torch

from flowllm.kernels.workspace import Workspace


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
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_blocks: int,
    workspace: Workspace | None = None,
    name: str = "",
) -> torch.Tensor:
    """The first `num_blocks` blocks of each row of `block_tables`, as [B, L, kv_heads, D]
    (in the workspace buffer `name` when a workspace is given)."""
    if num_blocks > block_tables.shape[1]:
        raise KernelInputError(
            f"a sequence needs {num_blocks} blocks but block_tables has only "
            f"{block_tables.shape[1]} columns"
        )
    blocks = block_tables[:, :num_blocks]  # [B, nb], int32 or int64
    flat = blocks.reshape(-1)
    if workspace is None:
        gathered = cache.index_select(0, flat)  # [B * nb, bs, kv_heads, D]
    else:
        into = workspace.get(name, (flat.numel(), *cache.shape[1:]), cache.dtype, cache.device)
        gathered = torch.index_select(cache, 0, flat, out=into)
    return gathered.view(blocks.shape[0], num_blocks * cache.shape[1], *cache.shape[2:])


def check_attention_inputs(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Raise `KernelInputError` unless the shapes describe one batch (see `paged_attention`)."""
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
    workspace: Workspace | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its paged context (GQA aware);
    max_query_len and max_seq_len are the callers' common signature, unused here.
    window > 0: a query at position p sees positions p - window < j <= p only (a sliding
    window); softcap > 0: scores become softcap * tanh(score / softcap), as Gemma 2's."""
    # query: [num_tokens, num_heads, head_dim]; returns the same shape.
    check_attention_inputs(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    block_size = k_cache.shape[1]
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_len = qsl[i + 1] - qsl[i]
        if q_len > seq_len:
            raise KernelInputError(f"sequence {i} has {q_len} queries but seq_len {seq_len}")
        if q_len == 0:
            continue
        nb = -(-seq_len // block_size)
        tables = block_tables[i : i + 1]
        # [kvh, L, D] views whose strides do not depend on L
        keys = _gather_context(k_cache, tables, nb, workspace, "k")[0].transpose(0, 1)
        values = _gather_context(v_cache, tables, nb, workspace, "v")[0].transpose(0, 1)
        for j in range(q_len):
            length = seq_len - q_len + j + 1  # the row's position + 1
            first = max(length - window, 0) if window > 0 else 0
            row = qsl[i] + j
            out[row] = _attend_row(
                query[row], keys[:, first:length], values[:, first:length], scale, softcap
            )
    return out


def _attend_row(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """One query row over its keys: scores rounded to q's dtype by the product, capped in
    float32 (softcap > 0), softmax in float32, probabilities cast back, as transformers'
    eager attention does."""
    # q: [H, D]; k, v: [kvh, L, D] -> [H, D]
    num_heads, head_dim = q.shape
    kv_heads = k.shape[0]
    queries = q.view(kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.bmm(queries, k.transpose(1, 2)).float().mul_(scale)  # [kvh, group, L]
    if softcap > 0:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.bmm(probs, v).view(num_heads, head_dim)
