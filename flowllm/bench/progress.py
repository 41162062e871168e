"""A small progress bar for terminals: `  42%|######    | 42/100 [00:03<00:04, 12.1 req/s]`.

It redraws one line with a carriage return, at most every `min_interval` seconds, and does
nothing at all when disabled (output is not a terminal, or the user turned it off), so
logs and pipes never fill with control characters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO


def format_duration(seconds: float) -> str:
    """`mm:ss`, or `h:mm:ss` past an hour."""
    total = max(0, int(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def render_bar(done: int, total: int, elapsed: float, width: int = 30, unit: str = "req") -> str:
    """The text of the bar after `done` of `total` items in `elapsed` seconds."""
    fraction = done / total if total > 0 else 1.0
    filled = min(width, int(fraction * width))
    rate = done / elapsed if elapsed > 0 else 0.0
    remaining = (total - done) / rate if rate > 0 else 0.0
    eta = format_duration(remaining) if rate > 0 else "?"
    return (
        f"{fraction * 100:5.1f}%|{'#' * filled}{' ' * (width - filled)}| {done}/{total} "
        f"[{format_duration(elapsed)}<{eta}, {rate:.2f} {unit}/s]"
    )


class ProgressBar:
    """Counts finished items and redraws the bar on `stream` when enabled."""

    def __init__(
        self,
        total: int,
        stream: TextIO,
        *,
        enabled: bool,
        min_interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.done = 0
        self._stream = stream
        self._enabled = enabled
        self._min_interval = min_interval
        self._clock = clock
        self._start = clock()
        self._last_draw = float("-inf")
        self._drawn = -1  # `done` as last drawn

    def update(self, n: int = 1) -> None:
        """Count `n` more finished items; redraw if enough time passed or all are done."""
        self.done += n
        now = self._clock()
        if self._enabled and (
            now - self._last_draw >= self._min_interval or self.done >= self.total
        ):
            self._draw(now)

    def close(self) -> None:
        """Draw the final state (unless already shown) and end the line."""
        if self._enabled:
            if self._drawn != self.done:
                self._draw(self._clock())
            self._stream.write("\n")
            self._stream.flush()
            self._enabled = False

    def _draw(self, now: float) -> None:
        self._last_draw = now
        self._drawn = self.done
        self._stream.write("\r" + render_bar(self.done, self.total, now - self._start))
        self._stream.flush()
