"""Fixtures for the HTTP API tests: the real GPT-2 tokenizer and a fake engine behind it."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/api: api_fake_engine

from api_fake_engine import FakeEngine, make_app


@pytest.fixture(scope="session")
def tokenizer(gpt2_tokenizer: Any) -> Any:
    """The real GPT-2 tokenizer (from tests/conftest.py)."""
    return gpt2_tokenizer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokenizer)


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[AsyncTestClient[Litestar]]:
    async with AsyncTestClient(make_app(engine)) as test_client:
        yield test_client
