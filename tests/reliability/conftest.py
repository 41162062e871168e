"""Servers for the reliability suite: real `flowllm serve` processes on 127.0.0.1 running the
tiny GPT-2, one per test module so that a server one test brings down does not fail the
next; always stopped by the fixture's finalizer.

The scale (`FLOWLLM_RELIABILITY_SCALE`: ci or full) is read by reliability_helpers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # e2e_helpers

from e2e_helpers import CHAT_TEMPLATE, start_server
from reliability_helpers import cap_memory
from server_process import TINY_FLAGS, ServerProcess, small_pending_graph


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def reliability_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reliability-template") / "chatml.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def tiny_server(gpt2_tiny_dir: Path, reliability_template: Path) -> Iterator[ServerProcess]:
    """The tiny GPT-2 (real tokenizer) on the default graph, with a ChatML template."""
    proc = start_server(
        str(gpt2_tiny_dir), [*TINY_FLAGS, "--chat-template", str(reliability_template)]
    )
    try:
        cap_memory(proc.process.pid)
        yield proc
    finally:
        proc.stop()


OVERLOAD_MAX_PENDING = 8  # requests ingest admits without output yet
OVERLOAD_MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def overload_server(
    gpt2_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The tiny GPT-2 on a copy of the default graph whose ingest admits only
    `OVERLOAD_MAX_PENDING` requests without output, with at most 4 sequences per step."""
    graph = small_pending_graph(
        tmp_path_factory.mktemp("reliability-graph") / "small-pending.yaml", OVERLOAD_MAX_PENDING
    )
    proc = start_server(
        str(gpt2_tiny_dir),
        [*TINY_FLAGS, "--max-num-seqs", str(OVERLOAD_MAX_NUM_SEQS)],
        graph=graph,
    )
    try:
        cap_memory(proc.process.pid)
        yield proc
    finally:
        proc.stop()
