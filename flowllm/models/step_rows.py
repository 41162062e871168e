"""The row counts at which an encoder runs its oneDNN products, so that a row's output never
depends on the other rows of its step.

Why: oneDNN blocks a product by its whole shape, row count included, and where it splits
the inputs' sum into blocks (bf16 on AMX with 768 inputs and more, at some row counts and
not others; float32 at one row) it adds each block's partial sum to the others in another
order: a row's output then moves in its last bits with the rows beside it
(benchmarks/README.md "Embeddings"). The same shape and thread count always split the same
way, and one call treats all its rows alike, so a step padded up to a row count of the
same split as every other gives each row the same sums in every step.

Which row counts split alike depends on the shapes, the thread count and the CPU, so it is
measured, once, in the thread that runs the products: each product runs the same random
rows at each candidate count and in one call of the largest count, and the counts that
reproduce every output of the largest are kept. A different split changes some of those
outputs in their last bits (tens at least, at bge-small's shapes), the same split none.
Only oneDNN's packed products are measured and padded for: the native kernels sum each row
alone, and plain F.linear runs where oneDNN does not pack (off the CPU).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import torch

from flowllm.models.layers import Linear

# Candidate row counts: FIRST (a step of fewer rows costs about as much: benchmarks/
# README.md, "Embeddings"), its multiples up to COARSE_FROM, then multiples of COARSE_STEP
# (a step pads by a quarter of its rows at most).
FIRST = 32
COARSE_FROM = 1024
COARSE_STEP = 256


def candidate_counts(max_rows: int) -> list[int]:
    """The row counts tried for steps of at most `max_rows` rows, `max_rows` the last."""
    counts = [*range(FIRST, COARSE_FROM, FIRST), *range(COARSE_FROM, max_rows, COARSE_STEP)]
    return [c for c in counts if c < max_rows] + [max_rows]


def same_sums(linear: Linear, max_rows: int, counts: Sequence[int]) -> set[int]:
    """Which of `counts` give every row the outputs it has in one product of `max_rows`
    rows (the same random rows, blocks of each count one call each)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(max_rows, linear.in_features, generator=generator).to(linear.dtype)
    full = linear(x)
    return {
        count
        for count in counts
        if all(
            torch.equal(linear(x[start : start + count]), full[start : start + count])
            for start in range(0, max_rows - count + 1, count)
        )
    }


class StepRows:
    """The row counts that `linears` run a step at: `padded(rows)`, the least of them that
    holds `rows`. Measured at the first call (see module), in that call's thread."""

    def __init__(self, linears: Sequence[Linear], max_rows: int) -> None:
        if max_rows < 1:
            raise ValueError(f"a step holds at least one row, not {max_rows}")
        self.linears = list(linears)
        self.max_rows = max_rows
        self._counts: list[int] | None = None

    def onednn(self) -> list[Linear]:
        """The products that are oneDNN's (once the weights are packed)."""
        return [lin for lin in self.linears if lin.packed_weight is not None]

    def counts(self) -> list[int]:
        """The row counts steps run at, ascending (measured where some product is oneDNN's)."""
        if self._counts is None:
            kept = set(candidate_counts(self.max_rows))
            shapes: set[tuple[int, int]] = set()
            with torch.no_grad():
                for lin in self.onednn():
                    if (lin.in_features, lin.out_features) not in shapes:
                        shapes.add((lin.in_features, lin.out_features))
                        kept &= same_sums(lin, self.max_rows, sorted(kept))
            self._counts = sorted(kept)
        return self._counts

    def padded(self, rows: int) -> int:
        """The row count a step of `rows` rows runs at."""
        if rows > self.max_rows:
            raise ValueError(f"a step of {rows} rows, over the {self.max_rows} it was planned for")
        if not self.onednn():
            return rows
        counts = self.counts()
        return counts[bisect_left(counts, rows)]


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` [n, ...] with zero rows appended up to `rows` (`x` itself when it has them)."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])
