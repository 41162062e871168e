"""`flowllm serve`'s tool-calling flags, without a server."""

from __future__ import annotations

import pytest

from flowllm.cli import build_parser
from flowllm.serve_flags import ServeError, auto_tool_parser


def parser_of(*argv: str) -> str | None:
    return auto_tool_parser(build_parser().parse_args(["serve", *argv]))


def test_auto_tool_choice_needs_a_parser_and_names_it() -> None:
    assert parser_of() is None
    assert parser_of("--tool-call-parser", "hermes") is None  # auto not enabled
    assert parser_of("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json") == (
        "llama3_json"
    )
    with pytest.raises(ServeError, match="needs --tool-call-parser"):
        parser_of("--enable-auto-tool-choice")
    with pytest.raises(SystemExit):  # an unknown parser is refused by argparse
        parser_of("--enable-auto-tool-choice", "--tool-call-parser", "mistral")
