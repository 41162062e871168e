"""Fixtures of the load generator's tests: fake OpenAI-shaped servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from bench_fake_server import FakeOpenAIServer, ServerBehaviour


@pytest.fixture
def start_server() -> Iterator[Callable[..., FakeOpenAIServer]]:
    """Start fake servers with `start_server(ttft_s=..., ...)`; all stop when the test ends."""
    servers: list[FakeOpenAIServer] = []

    def start(**behaviour: Any) -> FakeOpenAIServer:
        server = FakeOpenAIServer(ServerBehaviour(**behaviour))
        server.start()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
