"""`flowllm serve --reasoning-parser` and `--default-chat-template-kwargs`, without a
server: what they parse to, and the one-line errors a bad value gets at startup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowllm.cli import build_parser
from flowllm.config import RequestLimits
from flowllm.serve_flags import ServeError, default_template_kwargs

REPO = Path(__file__).resolve().parents[2]


def serve_args(*argv: str) -> object:
    return build_parser().parse_args(["serve", *argv])


def test_the_flags_parse_as_vllms() -> None:
    args = serve_args(
        "--reasoning-parser", "deepseek_r1", "--default-chat-template-kwargs",
        '{"enable_thinking": false, "style": {"terse": true}}',
    )  # fmt: skip
    assert args.reasoning_parser == "deepseek_r1"  # type: ignore[attr-defined]
    defaults = default_template_kwargs(args, RequestLimits())  # type: ignore[arg-type]
    assert defaults == {"enable_thinking": False, "style": {"terse": True}}
    plain = serve_args()
    assert plain.reasoning_parser is None  # type: ignore[attr-defined]
    assert default_template_kwargs(plain, RequestLimits()) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ('{"tools": []}', "'tools' is set by the server"),
        ('{"a": {"b": {"c": 1}}}', "nest more than 2 levels"),
    ],
)
def test_defaults_are_held_to_a_requests_bounds(value: str, problem: str) -> None:
    args = serve_args("--default-chat-template-kwargs", value)
    limits = RequestLimits(max_chat_template_kwargs_depth=2)
    with pytest.raises(ServeError, match=problem) as raised:
        default_template_kwargs(args, limits)  # type: ignore[arg-type]
    assert str(raised.value).startswith("--default-chat-template-kwargs: ")


def serve(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowllm", "serve", *argv, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )


@pytest.mark.parametrize(
    ("argv", "code", "said"),
    [
        (
            ["--reasoning-parser", "granite"],
            2,
            ("--reasoning-parser: invalid choice: 'granite'", "deepseek_r1", "qwen3"),
        ),
        (
            ["--default-chat-template-kwargs", "enable_thinking=false"],
            2,
            ("argument --default-chat-template-kwargs: expected a JSON object such as "
             """'{"enable_thinking": false}', got 'enable_thinking=false'""",),
        ),
        (
            ["--default-chat-template-kwargs", '{"messages": []}'],
            1,
            ("error: --default-chat-template-kwargs: Invalid 'chat_template_kwargs': "
             "'messages' is set by the server and cannot be given as a template variable.",),
        ),
    ],
)  # fmt: skip
def test_bad_values_are_one_error_before_the_model_loads(
    tmp_path: Path, argv: list[str], code: int, said: tuple[str, ...]
) -> None:
    done = serve(str(tmp_path / "no-model-here"), *argv)
    assert done.returncode == code, done.stderr
    for words in said:
        assert words in done.stderr
    assert "Traceback" not in done.stderr
