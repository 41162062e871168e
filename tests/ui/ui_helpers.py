"""What the web page's tests share: where Chromium is, its console, screenshots.

Screenshots go to `test-artifacts/ui/` (FLOWLLM_TEST_ARTIFACTS moves it), kept after the
run as the tests' artifacts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from server_process import REPO

CHROMIUM = os.environ.get("FLOWLLM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
EXPECT_TIMEOUT_MS = 60_000  # the machines are shared: the page may wait a while under load
ARTIFACTS = Path(os.environ.get("FLOWLLM_TEST_ARTIFACTS", REPO / "test-artifacts")) / "ui"


class Console:
    """What a page wrote to its console, and the exceptions it raised."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def on_message(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def on_error(self, error: Any) -> None:
        self.errors.append(f"uncaught: {error}")


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path
