"""Helpers for the model tests: a tiny block allocator and step bookkeeping that drive
`ModelRunner` the way the scheduler does, and random-weight transformers references."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from flowllm.messages import ScheduledSeq


@dataclass
class PagedSeq:
    """One sequence's tokens, how many are in the cache, and its block table."""

    seq_id: int
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class Blocks:
    """Hands out distinct, shuffled block ids so tables are never contiguous by accident."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, seq: PagedSeq, num_tokens: int, block_size: int) -> None:
        while len(seq.blocks) * block_size < num_tokens:
            seq.blocks.append(self.free.pop())


def schedule(
    seq: PagedSeq, n: int, blocks: Blocks, block_size: int, sample: bool = True
) -> ScheduledSeq:
    """The next `n` uncomputed tokens of `seq` as a ScheduledSeq (allocating blocks)."""
    end = seq.num_computed + n
    if end > len(seq.tokens):
        raise ValueError("scheduling past the known tokens")
    blocks.grow(seq, end, block_size)
    return ScheduledSeq(
        seq_id=seq.seq_id,
        token_ids=tuple(seq.tokens[seq.num_computed : end]),
        num_computed_tokens=seq.num_computed,
        block_table=tuple(seq.blocks),
        sample=sample,
        num_output_tokens=0,
    )


def reference_logits(ref: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' logits for every position of `tokens`, computed from scratch."""
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()
