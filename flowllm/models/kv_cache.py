"""Size and allocate the paged KV cache: one K and one V tensor per layer, each
[num_blocks, block_size, num_kv_heads, head_dim].

On CPU the cache gets a fixed byte budget (`kv_cache_memory`); on CUDA what is left of the
engine's share of the device (`gpu_memory_utilization`, as vLLM's: a fraction of the
device's total memory for this engine, weights included) after its weights.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any

import torch

from flowllm.models.errors import KVCacheError

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one model's cache, independent of how many blocks it gets."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    @classmethod
    def for_model(cls, model: Any, block_size: int = 16) -> KVCacheSpec:
        """The spec of a flowllm model (anything with num_layers/num_kv_heads/head_dim/dtype)."""
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype, block_size)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def num_blocks_for(self, memory_bytes: int, setting: str = "kv_cache_memory") -> int:
        """How many blocks fit in `memory_bytes`; KVCacheError, naming the `setting` to
        raise, if not even one does."""
        n = int(memory_bytes) // self.bytes_per_block
        if n < 1:
            raise KVCacheError(
                f"KV cache memory of {memory_bytes} bytes holds no block "
                f"(one block needs {self.bytes_per_block} bytes); raise {setting}"
            )
        return n

    def allocate(self, num_blocks: int, device: torch.device | str) -> KVCaches:
        """Per-layer (k, v) tensors, zeroed so never-written slots hold finite values."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        try:
            return [
                (zeros(shape, self.dtype, device), zeros(shape, self.dtype, device))
                for _ in range(self.num_layers)
            ]
        except (RuntimeError, MemoryError) as exc:
            raise KVCacheError(
                f"could not allocate {num_blocks} KV blocks "
                f"({num_blocks * self.bytes_per_block} bytes) on {device}: {exc}"
            ) from exc


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor. On CPU its memory is an anonymous mapping, whose pages the OS
    provides already zeroed when they are first touched: a cache of gigabytes costs nothing
    at start-up and only the blocks in use become resident, where `torch.zeros` writes
    every byte before the server can start. (Not numpy's calloc: it asks for transparent
    huge pages, whose first touch compacts memory in the middle of a model step.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, nbytes)  # page-aligned; the tensor keeps it alive
    return torch.frombuffer(memory, dtype=dtype).view(shape)


def cache_memory_budget(
    device: torch.device | str,
    kv_cache_memory: int,
    gpu_memory_utilization: float,
    model_bytes: int = 0,
) -> int:
    """Bytes the cache may take: `kv_cache_memory` on CPU. On CUDA the engine's share,
    `gpu_memory_utilization` of the device's total memory whatever other engines or
    processes hold (so two engines on one GPU each name their own share), less its model's
    `model_bytes`; KVCacheError when that much is not free."""
    device = torch.device(device)
    if device.type != "cuda":
        return int(kv_cache_memory)
    free, total = torch.cuda.mem_get_info(device)
    return gpu_cache_budget(free, total, gpu_memory_utilization, model_bytes)


def gpu_cache_budget(free: int, total: int, gpu_memory_utilization: float, model_bytes: int) -> int:
    """`cache_memory_budget` on a device with `free` of `total` bytes free now, the model
    loaded."""
    share = int(total * gpu_memory_utilization)
    budget = share - model_bytes
    if budget > free:
        gib = 1024**3
        raise KVCacheError(
            f"gpu_memory_utilization={gpu_memory_utilization} gives this engine "
            f"{share / gib:.2f} GiB of the device's {total / gib:.2f} GiB; after its model "
            f"({model_bytes / gib:.2f} GiB) the KV cache would take {budget / gib:.2f} GiB, "
            f"but {free / gib:.2f} GiB are free (other engines or processes hold the rest): "
            "lower gpu_memory_utilization, or free the device"
        )
    return budget


def allocate_kv_cache(
    spec: KVCacheSpec,
    device: torch.device | str,
    kv_cache_memory: int = 2 * 1024**3,
    gpu_memory_utilization: float = 0.9,
    model_bytes: int = 0,
) -> tuple[int, KVCaches]:
    """Size the cache for `device` and allocate it: (num_blocks, per-layer (k, v))."""
    budget = cache_memory_budget(device, kv_cache_memory, gpu_memory_utilization, model_bytes)
    cuda = torch.device(device).type == "cuda"
    setting = "gpu_memory_utilization" if cuda else "kv_cache_memory"
    num_blocks = spec.num_blocks_for(budget, setting)
    return num_blocks, spec.allocate(num_blocks, device)
