"""What is wrong with a graph file: every problem found, each located, reported at once."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a graph file, located by line when known."""

    message: str
    line: int | None = None
    source: str = "<graph>"

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.line is not None else self.source
        return f"{where}: {self.message}"


class GraphValidationError(ValueError):
    """A graph file has problems; `problems` lists every one of them."""

    def __init__(self, problems: list[Problem] | tuple[Problem, ...]) -> None:
        self.problems = tuple(problems)
        count = len(self.problems)
        header = f"{count} problem{'s' if count != 1 else ''} in the graph:"
        super().__init__("\n".join([header, *(f"  {p}" for p in self.problems)]))


def suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """' (did you mean 'x'?)' for the nearest choice, or ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def known(choices: Iterable[str]) -> str:
    names = sorted(choices)
    return ", ".join(names) if names else "none"
