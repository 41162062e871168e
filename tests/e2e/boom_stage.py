"""A tokenize stage that fails on any prompt containing BOOM: a bug reachable by one
request, for the supervision tests against a real server."""

from __future__ import annotations

from typing import Any

from flowllm.stages.tokenize import Tokenize


class BoomError(RuntimeError):
    """The injected bug."""


class BoomTokenize(Tokenize):
    async def handle(self, message: Any, ctx: Any) -> None:
        request = getattr(message, "request", None)
        if request is not None and "BOOM" in (request.prompt or ""):
            raise BoomError("a bug in tokenize")
        await super().handle(message, ctx)
