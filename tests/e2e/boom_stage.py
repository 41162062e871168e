"""A tokenize stage that fails on any prompt containing BOOM (a bug reachable by one
request) and blocks a thread for HANG_S on one containing HANG (work that no
cancellation can stop), for the supervision tests against a real server."""

from __future__ import annotations

import time
from typing import Any

import anyio

from flowllm.stages.tokenize import Tokenize

HANG_S = 3.0


class BoomError(RuntimeError):
    """The injected bug."""


class BoomTokenize(Tokenize):
    async def handle(self, message: Any, ctx: Any) -> None:
        request = getattr(message, "request", None)
        if request is not None and "BOOM" in (request.prompt or ""):
            raise BoomError("a bug in tokenize")
        if request is not None and "HANG" in (request.prompt or ""):
            await anyio.to_thread.run_sync(time.sleep, HANG_S)
        await super().handle(message, ctx)
