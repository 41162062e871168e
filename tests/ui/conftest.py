"""Servers and a headless Chromium for the web page's tests.

The browser is Debian's `chromium` (`make setup` installs it) driven by Playwright for
Python through `executable_path`: Playwright's own browser downloads are never used.
Every page records its console: a test fails on any error there.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # e2e_helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # ui_helpers

from e2e_helpers import API_KEY, CHAT_TEMPLATE, start_server
from server_process import TINY_FLAGS, ServerProcess
from ui_helpers import CHROMIUM, EXPECT_TIMEOUT_MS, Console


@pytest.fixture(scope="session")
def ui_chat_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ui-template") / "chatml.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


def warm_server(model: str, flags: list[str], api_key: str = "unused") -> ServerProcess:
    """A healthy server that has answered once (its first steps are the slow ones)."""
    proc = start_server(model, flags)
    try:
        proc.client(api_key).completions.create(model=proc.model, prompt="Hi", max_tokens=4)
    except BaseException:
        proc.stop()
        raise
    return proc


@pytest.fixture(scope="session")
def ui_server(gpt2_tiny_dir: Path, ui_chat_template: Path) -> Iterator[ServerProcess]:
    """The tiny GPT-2 with a chat template, no API key."""
    proc = warm_server(str(gpt2_tiny_dir), [*TINY_FLAGS, "--chat-template", str(ui_chat_template)])
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def ui_auth_server(gpt2_tiny_dir: Path, ui_chat_template: Path) -> Iterator[ServerProcess]:
    """The same behind `--api-key`."""
    flags = [*TINY_FLAGS, "--chat-template", str(ui_chat_template), "--api-key", API_KEY]
    proc = warm_server(str(gpt2_tiny_dir), flags, API_KEY)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Chromium for one module: Playwright's sync API keeps an event loop running in this
    thread until it exits, which tests elsewhere that start their own loop cannot share."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: `make setup` installs Debian's chromium")
    from playwright.sync_api import expect, sync_playwright

    # The machines are shared: waiting for the page may take a while under load.
    expect.set_options(timeout=EXPECT_TIMEOUT_MS)

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[tuple[Any, Console]]:
    """A fresh page (its own context: clean sessionStorage) whose console must stay clean."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(EXPECT_TIMEOUT_MS)
    page = context.new_page()
    console = Console()
    page.on("console", console.on_message)
    page.on("pageerror", console.on_error)
    try:
        yield page, console
    finally:
        context.close()
    assert console.errors == [], console.errors
