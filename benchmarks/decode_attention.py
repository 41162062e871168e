"""Decode attention over the paged KV cache, one layer: the plain way (gather each
sequence's blocks into a fresh tensor, one masked SDPA), `flowllm.kernels.reference` and
the native kernel (`flowllm.kernels.cpu_attention`, where the library loads).

Runs in a worker thread, as the execute stage does (fresh large tensors page-fault there
every step), one torch thread, timed in process CPU seconds (best of --repeats):

    .venv/bin/python benchmarks/decode_attention.py
"""

from __future__ import annotations

import argparse
import threading
from functools import partial

import torch
import torch.nn.functional as F
from model_step import best_time  # benchmarks/ is on sys.path when run as a script

from flowllm import openmp
from flowllm.kernels import cpu_attention, reference
from flowllm.kernels.workspace import Workspace
from flowllm.models.glibc_heap import keep_freed_memory_mapped

BLOCK = 16
HEAD_DIM = 64
# (batch, context, query heads, kv heads): GPT-2 124M and SmolLM2-135M head layouts
CASES = [
    (1, 512, 12, 12), (8, 512, 12, 12), (64, 192, 12, 12), (256, 192, 12, 12),
    (1, 512, 9, 3), (32, 192, 9, 3), (256, 192, 9, 3),
]  # fmt: skip

Inputs = tuple[torch.Tensor, ...]


def make_inputs(batch: int, ctx: int, heads: int, kv_heads: int, dtype: torch.dtype) -> Inputs:
    """Query, caches, block tables (blocks in random order), query offsets, lengths in
    [ctx / 2, ctx]."""
    g = torch.Generator().manual_seed(0)
    per_seq = -(-ctx // BLOCK)
    num_blocks = batch * per_seq + 1
    shape = (num_blocks, BLOCK, kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    tables = (torch.randperm(num_blocks - 1, generator=g) + 1).view(batch, per_seq).int()
    query = torch.randn(batch, heads, HEAD_DIM, generator=g).to(dtype)
    lens = torch.randint(ctx // 2, ctx + 1, (batch,), generator=g, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    return query, k_cache, v_cache, tables, starts, lens


def plain(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """Gather every sequence's blocks into fresh [B, L, kvh, D] tensors, one masked SDPA."""
    per_seq = -(-int(lens.max()) // BLOCK)
    blocks = tables[:, :per_seq].reshape(-1).long()
    b = query.shape[0]
    k = k_cache.index_select(0, blocks).view(b, per_seq * BLOCK, *k_cache.shape[2:])
    v = v_cache.index_select(0, blocks).view(b, per_seq * BLOCK, *v_cache.shape[2:])
    mask = torch.arange(k.shape[1])[None, :] < lens[:, None]
    return F.scaled_dot_product_attention(
        query[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=HEAD_DIM**-0.5,
        enable_gqa=query.shape[1] != k.shape[2],
    )[:, :, 0]  # fmt: skip


def native(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """The C kernel straight from the paged cache."""
    out = torch.empty_like(query)
    cpu_attention.decode_attention(query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, out)
    return out


def run(repeats: int) -> None:
    workspace = Workspace()
    openmp.size_pool(1)  # this worker thread's kernels and torch ops on one thread
    print("| batch | ctx | heads (q/kv) | dtype | plain ms | reference ms | native ms "
          "| native vs reference | max abs diff (native, reference vs plain) |")  # fmt: skip
    print("|---:|---:|---|---|---:|---:|---:|---:|---|")
    for batch, ctx, heads, kv_heads in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            inputs = make_inputs(batch, ctx, heads, kv_heads, dtype)
            ref = partial(
                reference.paged_attention, *inputs, HEAD_DIM**-0.5, 1, ctx, workspace=workspace
            )
            base, native_fn = partial(plain, *inputs), partial(native, *inputs)
            expected = base().float()
            diffs = [(fn().float() - expected).abs().max().item() for fn in (ref, native_fn)]
            ms = [1e3 * best_time(fn, repeats, "cpu", warmup=1) for fn in (base, ref, native_fn)]
            name = "fp32" if dtype == torch.float32 else "bf16"
            print(f"| {batch} | {ctx} | {heads}/{kv_heads} | {name} | {ms[0]:.3f} | {ms[1]:.3f} "
                  f"| {ms[2]:.3f} | {ms[1] / ms[2]:.1f}× | {diffs[1]:.1e}, {diffs[0]:.1e} |",
                  flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory_mapped()
    worker = threading.Thread(target=run, args=(args.repeats,))
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
