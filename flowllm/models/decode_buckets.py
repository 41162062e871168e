"""Decode steps padded to a few batch sizes, so that each size is captured once.

A CUDA graph replays fixed shapes on fixed buffers. A decode step of n sequences therefore
runs the graph of the smallest capture size >= n (vLLM's `cudagraph_capture_sizes`), its
layer inputs padded to that many rows and to one block-table width that holds any context
up to the engine's `max_model_len`. A padded row is a sequence of one token at position 0
whose K/V go to `pad_slot` (-1 on CUDA: the Triton store skips slots outside the cache) and
whose block table is all block 0: it reads one cached position, writes nothing a real
sequence owns, and its outputs are dropped. Every kernel of a step computes its rows
independently, so the real rows come out as the unpadded step's.

Device-agnostic: the same code pads CPU tensors in the tests.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# The default capture sizes' ceiling (vLLM's): a larger decode batch gains little from a
# graph, and every size costs capture time at start-up.
MAX_DEFAULT_CAPTURE_SIZE = 512

LayerInputs = tuple[torch.Tensor, ...]  # h, positions, slot_mapping, block_tables, qsl, seq_lens


def capture_sizes(
    max_num_seqs: int, sizes: Iterable[int] | None = None, max_size: int | None = None
) -> tuple[int, ...]:
    """The decode batch sizes to capture, ascending: `sizes`, or by default 1, 2, 4, 8,
    every multiple of 8 up to the limit and the limit itself. The limit is `max_size`
    (default: `MAX_DEFAULT_CAPTURE_SIZE` for the default sizes, none for given ones), and
    never above `max_num_seqs`, since no decode step is larger; sizes above it are
    dropped."""
    if max_size is None:
        max_size = MAX_DEFAULT_CAPTURE_SIZE if sizes is None else max_num_seqs
    limit = min(max_num_seqs, max_size)
    if sizes is None:
        sizes = [1, 2, 4, *range(8, limit + 1, 8), limit]
    return tuple(sorted({n for n in sizes if 1 <= n <= limit}))


@dataclass(frozen=True)
class DecodeBuckets:
    """The padded shapes of captured decode steps."""

    sizes: tuple[int, ...]  # rows of each captured step, ascending
    width: int  # block-table columns of every captured step
    block_size: int
    pad_slot: int  # the cache slot padded rows write to

    @classmethod
    def for_context(
        cls, sizes: Sequence[int], max_model_len: int, block_size: int, pad_slot: int = -1
    ) -> DecodeBuckets:
        """Buckets whose tables hold `max_model_len` tokens: the power of two of blocks
        `StepInputs` rounds the widest such table up to."""
        blocks = -(-max_model_len // block_size)
        return cls(tuple(sorted(sizes)), 1 << max(blocks - 1, 0).bit_length(), block_size, pad_slot)

    @property
    def max_seq_len(self) -> int:
        """The context bound captured steps run under (what their tables address): the
        attention's launch parameters are fixed for it, correct for every shorter one."""
        return self.width * self.block_size

    def rows_for(self, num_seqs: int, width: int) -> int | None:
        """The captured rows a decode step of `num_seqs` sequences and a `width`-column
        block table pads to; None when it is larger than every capture size or its table
        is wider (then it runs eagerly)."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) and width <= self.width else None

    def padding(self, h: torch.Tensor) -> LayerInputs:
        """Layer inputs of `len(h)` padding rows whose hidden states are `h`, typed as a
        step's (`flowllm.models.runner.StepInputs`): a captured step's static inputs."""
        rows, device = h.shape[0], h.device
        return (
            h,
            torch.zeros(rows, dtype=torch.int64, device=device),
            torch.full((rows,), self.pad_slot, dtype=torch.int64, device=device),
            torch.zeros((rows, self.width), dtype=torch.int32, device=device),
            torch.arange(rows + 1, dtype=torch.int32, device=device),
            torch.ones(rows, dtype=torch.int32, device=device),
        )

    def pad_into(self, out: LayerInputs, inputs: LayerInputs) -> None:
        """Write `inputs` (a decode step's layer inputs, n sequences, every one query) into
        the first rows of `out` (a captured step's) and padding rows into the rest."""
        h, positions, slots, tables, qsl, seq_lens = inputs
        o_h, o_positions, o_slots, o_tables, o_qsl, o_seq_lens = out
        n, width = tables.shape
        rows = o_tables.shape[0]
        o_h[:n].copy_(h)
        o_h[n:].zero_()
        o_positions[:n].copy_(positions)
        o_positions[n:].zero_()
        o_slots[:n].copy_(slots)
        o_slots[n:].fill_(self.pad_slot)
        o_tables[:n, :width].copy_(tables)
        o_tables[:n, width:].zero_()
        o_tables[n:].zero_()
        o_qsl[: n + 1].copy_(qsl)
        torch.arange(n + 1, rows + 1, out=o_qsl[n + 1 :])  # one query each
        o_seq_lens[:n].copy_(seq_lens)
        o_seq_lens[n:].fill_(1)
