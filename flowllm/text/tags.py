"""Tags in generated text that arrives in pieces.

A tag such as `</think>` or `<tool_call>` may be split across tokens, and so across the
pieces a reader gets; a reader holds back the end of a piece that could begin the tag
until the next piece says whether it does.
"""

from __future__ import annotations


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
