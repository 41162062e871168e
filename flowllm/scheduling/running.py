"""The running sequences as a table: one row per sequence, oldest first, its step counters
in columns.

A decode step reads and writes the same few counters of every running sequence. Held as
numpy columns, `Scheduler.schedule` and `Scheduler.apply` do that in a handful of array
operations per step rather than a pass over objects, and the step message's columns come
out of them by `tolist()`.

While a sequence runs, its row is the only place its step counters live (`MOVED`): the
`Sequence` attributes of the same names read and write the row. `append` moves them in,
`pop` and `remove` move them back out, so a waiting or finished sequence holds its own.
Where its newest in-flight token is sampled exists only while it runs. `num_tokens` and
`last_token` are kept with `Sequence.token_ids` by the scheduler, which appends to both at
once; the rest is fixed while the sequence lives.

Only the scheduler (flowllm.scheduling.scheduler) uses it.
"""

from __future__ import annotations

import array
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from flowllm.scheduling.kv_cache_manager import SeqBlocks
    from flowllm.scheduling.sequence import Sequence

Column = npt.NDArray[np.int64]
Flags = npt.NDArray[np.bool_]


class Columns:
    """One numpy array per column, `capacity` entries each, of which a table's first
    `len(table)` are its rows. Each views the memory of the column's `array.array` in
    `cells`, whose single entries Python reads and writes faster than numpy's: array
    operations go through the arrays, one row at a time through the cells."""

    # fixed while the sequence lives; `end`: the num_tokens its length limit ends it at
    seq_id: Column
    num_prompt: Column
    end: Column
    runs_ahead: Flags
    constrained: Flags
    pools: Flags
    # kept with `token_ids`, and the block record's `fast_limit`, by the scheduler
    num_tokens: Column
    last_token: Column
    fast_limit: Column
    # moved in while it runs (`MOVED`)
    num_computed_tokens: Column
    num_pending: Column
    num_dropped: Column
    wants_prompt_logits: Flags
    # while tokens are in flight for it: the step that samples the newest, and its row
    # among that step's sampling rows (where a placeholder reads it)
    sampled_step: Column
    sampled_row: Column

    def __init__(self, capacity: int) -> None:
        self.cells: dict[str, array.array[int]] = {}
        for name in COLUMNS:
            flag = name in FLAGS
            cells = array.array("b" if flag else "q", bytes((1 if flag else 8) * capacity))
            self.cells[name] = cells
            setattr(self, name, np.frombuffer(cells, np.bool_ if flag else np.int64))


COLUMNS = tuple(name for name in Columns.__annotations__ if name != "cells")
# The `Sequence` attributes that live in its row while it runs.
MOVED = ("num_computed_tokens", "num_dropped", "num_pending", "wants_prompt_logits")
FLAGS = frozenset({"constrained", "pools", "runs_ahead", "wants_prompt_logits"})


class RunningRows:
    """The running sequences in admission order (oldest first) and their `cols`.

    Rows keep their index while no sequence leaves; `generation` counts the departures, so
    a caller holding row indices knows when they went stale.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.seqs: list[Sequence] = []
        self.blocks: list[SeqBlocks] = []  # each row's block record (the KV manager's)
        self.cols = Columns(capacity)
        self.cells = self.cols.cells
        self.generation = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.seqs)

    def __getitem__(self, row: int) -> Sequence:
        return self.seqs[row]

    # ------------------------------------------------------------------ rows in and out
    def append(self, seq: Sequence, blocks: SeqBlocks) -> None:
        """Add a sequence that starts running (youngest), moving its counters in."""
        row = len(self.seqs)
        if row == self.capacity:
            raise RuntimeError(f"more than {self.capacity} running sequences")
        values = {
            "seq_id": seq.seq_id,
            "num_prompt": seq.num_prompt_tokens,
            "end": int(seq.num_prompt_tokens + seq.output_limit),
            "runs_ahead": seq.runs_ahead,
            "constrained": seq.params.structured_outputs is not None,
            "pools": seq.pooling is not None,
            "num_tokens": len(seq.token_ids),
            "last_token": seq.token_ids[-1],
            "fast_limit": blocks.fast_limit,
            "sampled_step": -1,
            "sampled_row": -1,
        }
        values.update((name, getattr(seq, name)) for name in MOVED)
        cells = self.cells
        for name, value in values.items():
            cells[name][row] = value
        self.seqs.append(seq)
        self.blocks.append(blocks)
        seq.enter_rows(self, row)

    def pop(self) -> Sequence:
        """Take the youngest sequence out (preemption), handing its counters back."""
        seq = self.seqs[-1]
        seq.leave_rows()
        self.seqs.pop()
        self.blocks.pop()
        self.generation += 1
        return seq

    def remove(self, leaving: list[Sequence]) -> None:
        """Take these sequences out, handing their counters back; the rows after them move
        up."""
        if not leaving:
            return
        n = len(self.seqs)
        keep = np.ones(n, np.bool_)
        first = n
        for seq in leaving:
            first = min(first, seq.running_row)
            keep[seq.running_row] = False
            seq.leave_rows()
        kept = int(keep.sum())
        for name in COLUMNS:
            column = getattr(self.cols, name)
            column[:kept] = column[:n][keep]
        flags = keep.tolist()
        self.seqs = [s for s, k in zip(self.seqs, flags, strict=True) if k]
        self.blocks = [b for b, k in zip(self.blocks, flags, strict=True) if k]
        for row in range(first, kept):
            self.seqs[row].running_row = row
        self.generation += 1
