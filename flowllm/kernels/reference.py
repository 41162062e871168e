"""Torch reference attention over the paged KV cache: the oracle the native and Triton
kernels are tested against, and the CPU path wherever the native library does not serve.

On CPU with the native library (float32 or bfloat16, head_dim a multiple of 16 or 32),
decode rows go to `flowllm.kernels.cpu_attention`, 3-10x faster per layer than `_decode`
here (it reads each K/V row once, in place, where `_decode` gathers first and, in half
precision, scores every kv head); the multi-query rows still run `attend_prefills` here.
Without the library (`FLOWLLM_NATIVE_KERNELS=0`, no AVX2, float16, other head sizes)
everything below runs.

Decode rows (one query per sequence) of a step run together, in chunks of sequences: a
chunk's cache blocks are gathered into one padded [b, max_len, kv_heads, head_dim] buffer
(reused across calls through a `Workspace`) and attended at once — by one masked
`scaled_dot_product_attention` in float32, by two batched products in half precision
(see `_attend_one_query_half`). Sequences with several queries (prefill chunks, possibly
after a cached prefix) attend one by one over their gathered context with a causal mask
shifted by the prefix length (`_attend_causal`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its paged context (GQA aware).

    `workspace` holds the gathered K/V between calls (see `flowllm.kernels.workspace`);
    without one, they are allocated per call."""
    # query: [num_tokens, num_heads, head_dim]; returns the same shape.
    check_attention_inputs(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    if decode:
        _decode(
            query, k_cache, v_cache, block_tables, qsl, lens, decode, scale, out,
            workspace if workspace is not None else Workspace(),
        )  # fmt: skip
    attend_prefills(query, k_cache, v_cache, block_tables, qsl, lens, scale, out)
    return out


def attend_prefills(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    qsl: list[int],
    lens: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Into `out`, the sequences with several queries (prefill chunks, possibly after a
    cached prefix), one by one over their gathered context; qsl and lens are
    query_start_loc and seq_lens as lists."""
    # query, out: [num_tokens, H, D]
    block_size = k_cache.shape[1]
    for i, seq_len in enumerate(lens):
        q_len = qsl[i + 1] - qsl[i]
        if q_len <= 1:
            continue
        if q_len > seq_len:
            raise KernelInputError(f"sequence {i} has {q_len} queries but seq_len {seq_len}")
        nb = -(-seq_len // block_size)
        k = _gather_context(k_cache, block_tables[i : i + 1], nb)[0, :seq_len]  # [L, kvh, D]
        v = _gather_context(v_cache, block_tables[i : i + 1], nb)[0, :seq_len]
        q = query[qsl[i] : qsl[i + 1]]  # [q_len, H, D]
        out[qsl[i] : qsl[i + 1]] = _attend_causal(q, k, v, seq_len - q_len, scale)


_SCORES_CHUNK_BYTES = 32 << 20  # float32 scores of one chunk of a prefill's queries


def _attend_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float
) -> torch.Tensor:
    """One sequence's queries after `prefix` cached tokens, causally over its context.

    Explicit products with a float32 softmax rather than CPU SDPA, which measured 1.2–2.6x
    slower for 128–512-token prefills (both dtypes, GPT-2 and SmolLM2 head layouts); the
    queries run in chunks so the [heads, queries, keys] scores stay under a bound.
    """
    # q: [q_len, H, D]; k, v: [L, kvh, D] with L = prefix + q_len -> [q_len, H, D]
    q_len, num_heads, head_dim = q.shape
    length, kv_heads = k.shape[0], k.shape[1]
    group = num_heads // kv_heads
    keys = k.permute(1, 2, 0)  # [kvh, D, L]
    values = v.transpose(0, 1)  # [kvh, L, D]
    # [kvh, group, q_len, D]: the query heads that share kv head j are rows of its product
    queries = q.view(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    out = torch.empty_like(q)
    rows = max(1, _SCORES_CHUNK_BYTES // (4 * num_heads * length))
    for r0 in range(0, q_len, rows):
        r1 = min(q_len, r0 + rows)
        n = r1 - r0
        chunk = queries[:, :, r0:r1].reshape(kv_heads, group * n, head_dim)
        scores = torch.bmm(chunk, keys).view(kv_heads, group, n, length).float()
        # query r sits at position prefix + r and sees keys at positions <= its own: -inf
        # above that diagonal, added (a broadcast masked_fill_ took 13x longer)
        hidden = torch.full((n, length), float("-inf"), device=q.device).triu_(prefix + r0 + 1)
        scores.mul_(scale).add_(hidden)
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(kv_heads, group * n, length)
        mixed = torch.bmm(probs, values).view(kv_heads, group, n, head_dim)
        out[r0:r1] = mixed.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
    return out


# Gathered K (and as much V) per chunk of decode sequences. float32 SDPA reads K/V per
# (sequence, head) and runs faster when a chunk stays in cache; the half-precision products
# pay per call and do best with large chunks (benchmarks/README.md "Kernel design figures").
_DECODE_CHUNK_BYTES_FP32 = 4 << 20
_DECODE_CHUNK_BYTES_HALF = 64 << 20


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    qsl: list[int],
    lens: list[int],
    decode: list[int],
    scale: float,
    out: torch.Tensor,
    workspace: Workspace,
) -> None:
    """The single-query sequences, in chunks whose gathered K/V stay under a bound.

    Each chunk's blocks are gathered into workspace buffers (padded to the chunk's longest
    context, the padding masked out) and attended at once. Bounding the chunk bounds the
    workspace (256 sequences of 2,048 tokens would otherwise gather GBs per layer).
    """
    device = query.device
    block_size = k_cache.shape[1]
    token_bytes = k_cache[0, 0].numel() * k_cache.element_size()
    fp32 = k_cache.dtype == torch.float32
    chunk_bytes = _DECODE_CHUNK_BYTES_FP32 if fp32 else _DECODE_CHUNK_BYTES_HALF
    all_decode = len(decode) == len(lens)
    start = 0
    while start < len(decode):
        stop, longest = start + 1, lens[decode[start]]
        while stop < len(decode):
            longer = max(longest, lens[decode[stop]])
            if longer * (stop + 1 - start) * token_bytes > chunk_bytes:
                break
            longest, stop = longer, stop + 1
        seqs = decode[start:stop]
        nb = -(-longest // block_size)
        if all_decode:
            q, tables = query[start:stop], block_tables[start:stop]
        else:
            rows = torch.tensor([qsl[i] for i in seqs], dtype=torch.int64, device=device)
            q = query.index_select(0, rows)
            tables = block_tables.index_select(0, rows.new_tensor(seqs))
        k = _gather_context(k_cache, tables, nb, workspace, "decode_k")
        v = _gather_context(v_cache, tables, nb, workspace, "decode_v")
        valid: torch.Tensor | None = None
        if len(seqs) == 1:  # one sequence attends over exactly its context
            k, v = k[:, :longest], v[:, :longest]
        else:
            seq_lens = torch.tensor([lens[i] for i in seqs], dtype=torch.int64, device=device)
            # Keys past a sequence's length (padding, stale slots) are masked out: [b, L]
            valid = torch.arange(k.shape[1], device=device)[None, :] < seq_lens[:, None]
        attend = _attend_one_query if fp32 else _attend_one_query_half
        o = attend(q, k, v, valid, scale)  # [b, H, D]
        if all_decode:
            out[start:stop] = o
        else:
            out.index_copy_(0, rows, o)
        start = stop


def _attend_one_query(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """float32: one masked SDPA over the padded batch (its CPU kernel reads K/V strided)."""
    # q: [b, H, D]; k, v: [b, L, kvh, D]; valid: [b, L] or None (all keys) -> [b, H, D]
    return F.scaled_dot_product_attention(
        q[:, :, None, :],
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=None if valid is None else valid[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[2],
    )[:, :, 0, :]


def _attend_one_query_half(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """bfloat16/float16: two batched products per sequence over all heads at once.

    CPU SDPA with one query per sequence is slow in half precision (benchmarks/README.md
    "Kernel design figures"). The query matrix is block-diagonal
    — head h's query sits in the rows of its kv head, zeros elsewhere — so one product
    with the [L, kv_heads * D] keys scores every head; it costs kv_heads times the FLOPs,
    cheap beside reading K/V. Scores are rounded to q's dtype by the product, softmax runs
    in float32 and the probabilities are cast back, as transformers' eager attention does.
    """
    # q: [b, H, D]; k, v: [b, L, kvh, D]; valid: [b, L] or None (all keys) -> [b, H, D]
    b, num_heads, head_dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    group = num_heads // kv_heads
    heads = torch.arange(kv_heads, device=q.device)
    q_diag = q.new_zeros(b, kv_heads, group, kv_heads, head_dim)
    q_diag[:, heads, :, heads, :] = q.view(b, kv_heads, group, head_dim).transpose(0, 1)
    keys = k.reshape(b, length, kv_heads * head_dim)
    scores = torch.bmm(q_diag.view(b, num_heads, kv_heads * head_dim), keys.transpose(1, 2))
    scores = scores.float()  # [b, H, L]
    scores.mul_(scale)
    if valid is not None:
        scores.masked_fill_(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    mixed = torch.bmm(probs, v.reshape(b, length, kv_heads * head_dim))
    # mixed: [b, H, kvh * D]; head h keeps the D columns of its own kv head
    mixed = mixed.view(b, kv_heads, group, kv_heads, head_dim)
    return mixed[:, heads, :, heads, :].permute(1, 0, 2, 3).reshape(b, num_heads, head_dim)
