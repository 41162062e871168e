"""Attention kernels over the paged KV cache, dispatched by device.

- CUDA: the Triton kernels (`flowllm.kernels.triton_attention`, imported on first use so
  CPU-only installs never load Triton).
- CPU with the native library (`flowllm.kernels.native`: x86-64 with AVX-512 or AVX2, the
  libraries prebuilt or C and C++ compilers, `FLOWLLM_NATIVE_KERNELS` not 0), float32 or
  bfloat16, head_dim a multiple of 16 or 32 respectively: every query row runs the C kernel
  straight from the cache (`flowllm.kernels.cpu_attention`), a prefill chunk's rows each as
  a decode query over the keys up to its own position, and K/V are stored by it too. So a
  row's attention is computed the same way whatever the step holds (decodes, prefill
  chunks, a recompute after preemption): batch invariance. At decode it reads each K/V row
  once, where it lies, and so takes less time than the reference, which gathers them first
  (benchmarks/README.md, "Where the time goes").
- Otherwise: the torch reference (`flowllm.kernels.reference`), also the oracle of both.

Two functions:

- `store_kv(key, value, k_cache, v_cache, slot_mapping)`
- `paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
  scale, max_query_len, max_seq_len, workspace, window, softcap) -> Tensor`

`workspace` holds the reference's scratch buffers; the other paths ignore it. `window`
(a sliding window: each query sees its last `window` positions, 0 all of them) and
`softcap` (scores capped as softcap * tanh(score / softcap), 0 not) are served by every
path alike.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from flowllm.kernels import cpu_attention, reference
from flowllm.kernels.workspace import Workspace

__all__ = ["implementation_for", "paged_attention", "store_kv"]


def implementation_for(device: torch.device) -> ModuleType:
    """The kernel module serving tensors on `device`: Triton on CUDA, else the reference
    (whose work the native kernels take where they serve it)."""
    if device.type == "cuda":
        try:
            return importlib.import_module("flowllm.kernels.triton_attention")
        except ModuleNotFoundError as exc:
            if exc.name != "triton":
                raise
            raise RuntimeError(
                "attention on CUDA needs Triton, which is not installed: "
                "pip install 'flowllm[cuda]'"
            ) from exc
    return reference


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write K/V rows into their paged-cache slots (see `reference.store_kv`)."""
    impl = implementation_for(key.device)
    if impl is reference and cpu_attention.serves(key, k_cache):
        impl = cpu_attention
    impl.store_kv(key, value, k_cache, v_cache, slot_mapping)


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
    """Causal paged attention with a cached-prefix offset (see `reference.paged_attention`)."""
    args = (query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
    impl = implementation_for(query.device)
    if impl is not reference:
        out: torch.Tensor = impl.paged_attention(
            *args, max_query_len, max_seq_len, window=window, softcap=softcap
        )
        return out
    if cpu_attention.serves(query, k_cache):
        return _native_cpu(*args, max_query_len, window, softcap)
    return reference.paged_attention(*args, max_query_len, max_seq_len, workspace, window, softcap)


def _native_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """Every row by the C kernel, each as one query over its sequence's keys up to its own
    position."""
    # query: [num_tokens, H, D] -> [num_tokens, H, D], contiguous
    reference.check_attention_inputs(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens
    )
    out = torch.empty(query.shape, dtype=query.dtype)
    num_seqs, num_tokens = seq_lens.shape[0], query.shape[0]
    if max_query_len == 1 and num_tokens == num_seqs:  # every sequence one query: row i
        cpu_attention.decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, scale, out,
            window=window, softcap=softcap,
        )  # fmt: skip
        return out
    ends = query_start_loc[1:].to(torch.int64)
    q_lens = ends - query_start_loc[:-1].to(torch.int64)
    if bool((q_lens > seq_lens).any()):
        bad = int(torch.nonzero(q_lens > seq_lens)[0])
        raise reference.KernelInputError(
            f"sequence {bad} has {int(q_lens[bad])} queries but seq_len {int(seq_lens[bad])}"
        )
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
    # row r of sequence s sits at position seq_lens[s] - (ends[s] - r)
    row_lens = seq_lens[seq_of_row] - ends[seq_of_row] + torch.arange(num_tokens) + 1
    tables = block_tables.index_select(0, seq_of_row)
    cpu_attention.decode_attention(
        query, k_cache, v_cache, tables, row_lens.to(torch.int32), scale, out,
        window=window, softcap=softcap,
    )  # fmt: skip
    return out
