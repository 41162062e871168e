"""The uniforms of seeded sequences, drawn ahead in blocks so a step reads them in one gather.

A seeded, non-greedy sequence owns a generator seeded from `sibling_seed(seed, index)`, and
its k-th random step draws with the k-th uniform of that generator's stream. Calling each
sequence's generator once per step costs a few torch calls per sequence; instead each
sequence's next `BLOCK` uniforms wait in one row of a table on the logits' device, filled by
one `torch.rand(BLOCK)` call, and a step reads every seeded row's next uniform with one gather
(`draw`). A row is refilled from its generator when its block is used up.

The stream is the generator's, consumed in order whatever else is in the batch, so a seeded
sequence draws the same uniforms alone or in any company. On the CPU one draw of BLOCK
uniforms is BLOCK draws of one (the Mersenne Twister is consumed serially), so these are the
uniforms of one `torch.rand(1)` per step; on CUDA they are Philox's, a block at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

BLOCK = 256  # uniforms drawn ahead per sequence


class SeededUniforms:
    """Per-sequence generators and their next uniforms, one table row (a slot) each."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._table = torch.empty(0, BLOCK, dtype=torch.float32, device=device)  # [slots, BLOCK]
        self._next = np.zeros(0, dtype=np.int64)  # [slots] index of each slot's next uniform
        self._generators: list[torch.Generator | None] = []  # by slot; None: free
        self._free: list[int] = []

    def __len__(self) -> int:
        """Slots in use."""
        return len(self._generators) - len(self._free)

    def add(self, seed: int) -> int:
        """A slot for a new sequence whose generator is seeded with `seed`."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        generator = torch.Generator(device=self._device)
        generator.manual_seed(seed % 2**64)
        self._generators[slot] = generator
        self._refill(slot)
        return slot

    def remove(self, slot: int) -> None:
        """Free a slot (its sequence finished or was released)."""
        if self._generators[slot] is None:
            raise ValueError(f"slot {slot} is not in use")
        self._generators[slot] = None
        self._free.append(slot)

    def draw(self, slots: Sequence[int]) -> torch.Tensor:
        """The next uniform of each slot ([len(slots)] float32 on the device), each slot's
        stream advanced by one. Slots must be distinct."""
        idx = np.fromiter(slots, dtype=np.int64, count=len(slots))
        pos = self._next[idx]
        flat = torch.from_numpy(idx * BLOCK + pos).to(self._device, non_blocking=True)
        u = self._table.view(-1).index_select(0, flat)
        pos += 1
        self._next[idx] = pos
        for slot in idx[pos == BLOCK].tolist():  # used up: the generator's next block
            self._refill(slot)
        return u

    def _refill(self, slot: int) -> None:
        generator = self._generators[slot]
        assert generator is not None
        torch.rand(BLOCK, generator=generator, device=self._device, out=self._table[slot])
        self._next[slot] = 0

    def _grow(self) -> None:
        old = len(self._generators)
        new = max(16, 2 * old)
        table = torch.empty(new, BLOCK, dtype=torch.float32, device=self._device)
        table[:old] = self._table
        self._table = table
        self._next = np.concatenate([self._next, np.zeros(new - old, dtype=np.int64)])
        self._generators.extend([None] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))  # lowest slot first
