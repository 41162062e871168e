"""Real `flowllm serve` processes on 127.0.0.1 for the end-to-end tests.

Each server is `python -m flowllm serve` in a subprocess on a free port, waited for on
`/health`, and always terminated by its fixture's finalizer. A server that does not come up
fails the test with its own stderr. The servers are session-scoped: starting one loads the
model and the tokenizer, which costs seconds on the 2-core machines.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/e2e: e2e_helpers

from e2e_helpers import (
    API_KEY,
    CHAT_TEMPLATE,
    FLOOD_MAX_PENDING,
    start_server,
)
from model_fixtures import QWEN3_STYLE_TEMPLATE, THINKING_MODEL, build_next_token_qwen3_dir
from server_process import TINY_FLAGS, ServerProcess, small_pending_graph


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def chat_template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("e2e-template") / "chatml.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def server(gpt2_tiny_dir: Path, chat_template_file: Path) -> Iterator[ServerProcess]:
    """The tiny GPT-2 (real tokenizer), no API key, with a ChatML template for chat."""
    proc = start_server(
        str(gpt2_tiny_dir), [*TINY_FLAGS, "--chat-template", str(chat_template_file)]
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def auth_server(gpt2_tiny_dir: Path) -> Iterator[ServerProcess]:
    """The tiny GPT-2 behind `--api-key`."""
    proc = start_server(str(gpt2_tiny_dir), [*TINY_FLAGS, "--api-key", API_KEY])
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def flood_server(
    gpt2_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The tiny GPT-2 on a copy of the default graph whose ingest admits only
    `FLOOD_MAX_PENDING` requests without output, and at most 2 sequences per step."""
    graph = small_pending_graph(
        tmp_path_factory.mktemp("e2e-graph") / "small-pending.yaml", FLOOD_MAX_PENDING
    )
    proc = start_server(str(gpt2_tiny_dir), [*TINY_FLAGS, "--max-num-seqs", "2"], graph=graph)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def bundled_server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    """The README's `flowllm serve` (no model argument: the bundled default), on a free port."""
    cache = smollm2_dir.parent.parent  # <cache>/models/smollm2-135m-instruct
    proc = start_server(None, [], env={"FLOWLLM_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def structured_server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    """The bundled SmolLM2 with auto tool choice read by the hermes parser."""
    cache = smollm2_dir.parent.parent  # <cache>/models/smollm2-135m-instruct
    proc = start_server(
        None,
        ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        env={"FLOWLLM_CACHE": str(cache), "HF_HUB_OFFLINE": "1"},
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def reasoning_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A Qwen3 that thinks by script (`THINKING_MODEL`, a Qwen3-style template), served
    with the qwen3 reasoning parser and thinking off by default."""
    model = build_next_token_qwen3_dir(
        tmp_path_factory.mktemp("thinking-qwen3"),
        THINKING_MODEL,
        added_tokens=("<think>", "</think>"),
        chat_template=QWEN3_STYLE_TEMPLATE,
    )
    flags = [
        *TINY_FLAGS,
        "--reasoning-parser", "qwen3",
        "--default-chat-template-kwargs", '{"enable_thinking": false}',
    ]  # fmt: skip
    proc = start_server(str(model), flags)
    try:
        yield proc
    finally:
        proc.stop()
