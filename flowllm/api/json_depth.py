"""How deeply a JSON body nests, found before it is decoded.

A decoder recurses once per nested array or object, so a small body of 50,000 `[` costs
it a deep stack (msgspec raises RecursionError). The check is cheap: counting the
brackets at C speed (`maybe_too_deep`) settles almost every body (a body with no more
brackets than the limit cannot nest deeper); only a body with more gets the precise scan
(`nesting_depth`), vectorised (numpy) so that a 10 MB body costs milliseconds, not a
Python loop per byte.
"""

from __future__ import annotations

import numpy as np

_BACKSLASH, _QUOTE = ord("\\"), ord('"')
# +1 for a byte that opens an array or object, -1 for one that closes it.
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def maybe_too_deep(body: bytes, max_depth: int) -> bool:
    """False when the body certainly nests no deeper than `max_depth` (C-speed counts);
    True when `nesting_depth` must tell."""
    return body.count(b"[") + body.count(b"{") > max_depth


def nesting_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects, brackets inside strings not counted.

    Read as JSON up to the first syntax error, which is as far as a decoder goes: within
    valid JSON a backslash occurs only inside strings, where it escapes the next byte.
    Linear in the body's size; numpy releases the GIL, so callers may run it in a worker
    thread.
    """
    data = np.frombuffer(body, dtype=np.uint8)
    if data.size == 0:
        return 0
    steps = _STEP[data]
    quotes = np.flatnonzero(data == _QUOTE)
    if quotes.size:
        backslashes = np.flatnonzero(data == _BACKSLASH)
        if backslashes.size:
            # In each run of backslashes the 1st, 3rd, ... one escapes the byte after it.
            starts = np.ones(backslashes.size, dtype=bool)
            starts[1:] = backslashes[1:] != backslashes[:-1] + 1
            run_start = backslashes[starts][np.cumsum(starts) - 1]
            escaping = backslashes[(backslashes - run_start) % 2 == 0]
            quotes = quotes[~np.isin(quotes, escaping + 1, assume_unique=True)]
        # Between an opening quote and its closing one, brackets are text.
        marks = np.zeros(data.size + 1, dtype=np.int8)
        marks[quotes[0::2]] = 1
        marks[quotes[1::2]] = -1
        inside = np.cumsum(marks[:-1], dtype=np.int8).view(bool)
        steps[inside] = 0
    return int(max(0, np.cumsum(steps, dtype=np.int32).max()))
