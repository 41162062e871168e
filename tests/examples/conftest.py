"""Fixtures for the example-graph tests: real servers on 127.0.0.1, always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from example_server import example_server
from server_process import ServerProcess

StartServer = Callable[..., ServerProcess]


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def default_server(gpt2_tiny_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    """The tiny GPT-2 behind the built-in graph: the reference the examples compare with."""
    server = example_server(gpt2_tiny_dir, None, server_logs)
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


@pytest.fixture
def start_server(gpt2_tiny_dir: Path, server_logs: Path) -> Iterator[StartServer]:
    """`start_server(graph, cwd=None)`: a healthy server on that graph, stopped at teardown."""
    started: list[ServerProcess] = []

    def start(graph: Path, cwd: Path | None = None) -> ServerProcess:
        server = example_server(gpt2_tiny_dir, graph, server_logs, cwd=cwd)
        started.append(server)
        return server.wait_healthy()

    try:
        yield start
    finally:
        for server in started:
            server.stop()
