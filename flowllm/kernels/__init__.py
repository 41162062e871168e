"""Attention kernels over the paged KV cache, dispatched by device.

CUDA tensors go to the Triton kernels (`flowllm.kernels.triton_attention`, imported on
first use so CPU-only installs never load Triton); everything else runs the torch
reference (`flowllm.kernels.reference`). Both implement the same two functions:

- `store_kv(key, value, k_cache, v_cache, slot_mapping)`
- `paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
  scale, max_query_len, max_seq_len) -> Tensor`

The reference also takes the caller's `Workspace` for its scratch buffers.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from flowllm.kernels import reference
from flowllm.kernels.workspace import Workspace

__all__ = ["implementation_for", "paged_attention", "store_kv"]


def implementation_for(device: torch.device) -> ModuleType:
    """The kernel module serving tensors on `device`."""
    if device.type == "cuda":
        return importlib.import_module("flowllm.kernels.triton_attention")
    return reference


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write K/V rows into their paged-cache slots (see `reference.store_kv`)."""
    implementation_for(key.device).store_kv(key, value, k_cache, v_cache, slot_mapping)


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
    """Causal paged attention with a cached-prefix offset (see `reference.paged_attention`)."""
    impl = implementation_for(query.device)
    # only the reference keeps scratch buffers; the Triton kernels allocate on the device
    extra = {"workspace": workspace} if impl is reference else {}
    return impl.paged_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        max_query_len,
        max_seq_len,
        **extra,
    )
