"""nesting_depth agrees with a byte-by-byte JSON reading; the check (maybe_too_deep, then
nesting_depth, as the API decodes bodies) is cheap for big bodies."""

from __future__ import annotations

import random
import time

import pytest

from flowllm.api.json_depth import maybe_too_deep, nesting_depth


def too_deep(body: bytes, max_depth: int) -> bool:
    """The API's check (`ApiState.decode`): count first, scan only when counting can't say."""
    return maybe_too_deep(body, max_depth) and nesting_depth(body) > max_depth


def reference_depth(text: str) -> int | None:
    """Depth read as JSON; None when a backslash occurs outside a string (invalid JSON,
    where a decoder stops)."""
    depth = deepest = 0
    inside = escaped = False
    for ch in text:
        if inside:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                inside = False
        elif ch == "\\":
            return None
        elif ch == '"':
            inside = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


@pytest.mark.parametrize(
    ("body", "depth"),
    [
        (b"", 0),
        (b"{}", 1),
        (b'{"a": [[1], [2, [3]]]}', 4),
        (b'{"a": "[[[["}', 1),
        (b'{"a": "\\"[[["}', 1),  # an escaped quote does not end the string
        (b'{"a": "\\\\", "b": [[]]}', 3),  # an escaped backslash does not escape the quote
    ],
)
def test_known_depths(body: bytes, depth: int) -> None:
    assert nesting_depth(body) == depth


def test_random_bodies_agree_with_the_reference() -> None:
    rng = random.Random(7)
    checked = 0
    for _ in range(5000):
        text = "".join(rng.choice('[]{}"\\a') for _ in range(rng.randint(0, 30)))
        expected = reference_depth(text)
        if expected is None:
            continue
        checked += 1
        assert nesting_depth(text.encode()) == expected, text
    assert checked > 1000


def test_counting_settles_shallow_bodies_and_the_scan_is_fast() -> None:
    assert not maybe_too_deep(b'{"prompt": [[1, 2]]}', 64)
    assert too_deep(b"[" * 65 + b"]" * 65, 64)
    assert not too_deep(b'["' + b"[" * 1000 + b'"]', 64)
    wide = b"[" + b"[]," * 1_000_000 + b"[]]"  # 3 MB of brackets, 2 levels deep
    start = time.perf_counter()
    assert not too_deep(wide, 64)
    assert time.perf_counter() - start < 0.5
