"""The block tables kept across steps: every step's array and lengths equal ones built
from scratch, and a row is rewritten only when its table is a different object."""

from __future__ import annotations

import random

import numpy as np

from flowllm.models.block_tables import BlockTables


def from_scratch(tables: list[tuple[int, ...]], width: int) -> np.ndarray:
    want = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        want[i, : len(t)] = t
    return want


def update(kept: BlockTables, tables: list[tuple[int, ...]]) -> np.ndarray:
    lengths = [len(t) for t in tables]
    width = 1 << max(max(lengths, default=0) - 1, 0).bit_length()  # a power of two
    got, got_lengths = kept.update(tables)
    assert got.dtype == np.int32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, from_scratch(tables, width))
    assert got_lengths.tolist() == lengths
    return got


def test_every_step_equals_tables_built_from_scratch() -> None:
    rng = random.Random(0)
    kept = BlockTables()
    running: list[tuple[int, ...]] = []
    next_block = 1
    for _ in range(400):
        event = rng.random()
        if event < 0.15 or not running:  # a sequence joins, at the end
            running.append(tuple(range(next_block, next_block + rng.randint(0, 9))))
            next_block += 20
        elif event < 0.3:  # one leaves: the rows after it move up
            running.pop(rng.randrange(len(running)))
        elif event < 0.35:  # preempted and readmitted with fewer blocks
            i = rng.randrange(len(running))
            running[i] = running[i][: rng.randint(0, len(running[i]))]
        for i in range(len(running)):  # some gain a block: a new tuple
            if rng.random() < 0.2:
                running[i] = (*running[i], next_block)
                next_block += 1
        update(kept, list(running))


def test_a_row_is_rewritten_only_when_its_table_is_another_object() -> None:
    kept = BlockTables()
    a, b = (3, 4), (5,)
    got = update(kept, [a, b])
    got[0, 1] = 99  # not written by update: shows whether it writes row 0 again
    got, _ = kept.update([a, b])
    assert got[0].tolist() == [3, 99]
    got = update(kept, [tuple([3, 4]), b])  # equal, but another tuple: rewritten
    assert got[0].tolist() == [3, 4]


def test_a_new_width_or_more_rows_rebuilds_every_row() -> None:
    kept = BlockTables()
    tables = [(1,), (2,)]
    update(kept, tables)
    update(kept, [*tables, (3, 4, 5)])  # wider and longer
    update(kept, tables)  # narrower again
    update(kept, [])


def test_the_kept_array_grows_only_with_the_rows_and_the_width() -> None:
    """A width that comes and goes (the longest sequence leaving and another growing) must
    not grow the kept rows: a new width keeps the row count."""
    kept = BlockTables()
    short, long = [(1,)] * 8, [(1,)] * 7 + [tuple(range(1, 40))]
    for _ in range(200):
        update(kept, short)
        update(kept, long)
    assert kept.nbytes <= 2 * 8 * 64 * 4
