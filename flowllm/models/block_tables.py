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
    block 0, and the table object each row was written from."""

    def __init__(self) -> None:
        self._array: np.ndarray[Any, np.dtype[np.int32]] = np.zeros((0, 0), dtype=np.int32)
        self._held: list[tuple[int, ...]] = []  # row i was written from _held[i]

    @property
    def nbytes(self) -> int:
        """What the kept array holds: at most twice the most rows a step had, times the
        widest table's width."""
        return self._array.nbytes

    def update(
        self, tables: Sequence[tuple[int, ...]], lengths: np.ndarray[Any, Any], width: int
    ) -> np.ndarray[Any, np.dtype[np.int32]]:
        """Row i holds `tables[i]` (of `lengths[i]` entries, at most `width`) padded with
        block 0: a view of the kept array, valid until the next update."""
        n = len(tables)
        array, held = self._array, self._held
        if array.shape[1] != width or array.shape[0] < n:
            capacity = array.shape[0] if n <= array.shape[0] else max(n, 2 * array.shape[0])
            array = np.zeros((capacity, width), dtype=np.int32)
            self._array, held = array, []
        self._held = []  # until every stale row is written
        stale = list(compress(range(n), map(is_not, tables, held)))
        stale.extend(range(len(held), n))
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
        return array[:n]
