"""Server-sent events survive clients that split lines more eagerly than SSE does."""

from __future__ import annotations

import json

import msgspec
from httpx._decoders import LineDecoder

from flowllm.api.completions import sse

AWKWARD = "a\u2028b\u2029c\x85d\x0be\x1cf\ng\rh é"


def test_event_is_one_line_for_splitlines_and_httpx() -> None:
    event = sse(msgspec.json.Encoder(), {"text": AWKWARD})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    text = event.decode()
    assert len(text[: -len("\n\n")].splitlines()) == 1  # splitlines: the widest set of breaks
    lines = [line for line in LineDecoder().decode(text) if line]
    assert len(lines) == 1
    assert json.loads(lines[0][len("data: ") :]) == {"text": AWKWARD}
