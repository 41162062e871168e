"""A step's block tables, kept from one step to the next.

From one decode step to the next, a sequence's block table changes only when it gains a
block (one step in `block_size`), and a row of the batch changes only when a sequence
joins, leaves or moves. So the table array is kept across steps and a step rewrites only
the rows whose table is not the one that row held: the scheduler makes a new tuple each
time a table changes, so an unchanged table is the same object and costs one identity
test, where rebuilding every row from its tuple costs a Python pass over every block id.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, compress
from operator import is_not
from typing import Any

import numpy as np


class BlockTables:
    """The [rows, width] int32 array of the latest step's block tables, each padded with
    block 0 to a power-of-two width (so that decode steps share a few shapes: see
    step_plans), each row's table length, and the table object each row was written from."""

    def __init__(self) -> None:
        self._array: np.ndarray[Any, np.dtype[np.int32]] = np.zeros((0, 0), dtype=np.int32)
        self._lengths: np.ndarray[Any, np.dtype[np.int64]] = np.zeros(0, dtype=np.int64)
        self._held: list[tuple[int, ...]] = []  # row i was written from _held[i]

    @property
    def nbytes(self) -> int:
        """What the kept array holds: at most twice the most rows a step had, times the
        widest table's width."""
        return self._array.nbytes

    def update(
        self, tables: Sequence[tuple[int, ...]]
    ) -> tuple[np.ndarray[Any, np.dtype[np.int32]], np.ndarray[Any, np.dtype[np.int64]]]:
        """Row i holds `tables[i]` padded with block 0. Returns views of the kept arrays,
        valid until the next update: the tables [rows, width] and their lengths [rows]."""
        n = len(tables)
        held, lengths = self._held, self._lengths
        self._held = []  # until every stale row is written
        stale = list(compress(range(n), map(is_not, tables, held)))
        stale.extend(range(len(held), n))
        if lengths.shape[0] < n:
            lengths = np.zeros(max(n, 2 * lengths.shape[0]), dtype=np.int64)
            lengths[: len(held)] = self._lengths[: len(held)]
            self._lengths = lengths
        if stale:
            lengths[stale] = [len(tables[i]) for i in stale]
        width = 1 << max(int(lengths[:n].max(initial=0)) - 1, 0).bit_length()
        array = self._array
        if array.shape[1] != width or array.shape[0] < n:
            capacity = array.shape[0] if n <= array.shape[0] else max(n, 2 * array.shape[0])
            array = self._array = np.zeros((capacity, width), dtype=np.int32)
            stale = list(range(n))
        if stale:
            rows = np.asarray(stale, dtype=np.int64)
            array[rows] = 0
            lens = lengths[rows]
            count = int(lens.sum())
            row_of_entry = np.repeat(rows, lens)
            col_of_entry = np.arange(count) - np.repeat(np.cumsum(lens) - lens, lens)
            array[row_of_entry, col_of_entry] = np.fromiter(
                chain.from_iterable([tables[i] for i in stale]), dtype=np.int32, count=count
            )
        self._held = list(tables)
        return array[:n], lengths[:n]
