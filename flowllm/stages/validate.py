"""validate: reject bad parameters before any work is spent on them."""

from __future__ import annotations

from typing import Any

from flowllm.engine.validation import validate_request
from flowllm.messages import Abort, GenerateRequest, RequestError, ValidRequest
from flowllm.stages.base import PerMessageStage, StageContext
from flowllm.stages.services import EngineServices


class Validate(PerMessageStage):
    inputs = {"in": GenerateRequest | Abort}
    outputs = {"out": ValidRequest | Abort, "errors": RequestError}

    def __init__(self, params: Any, services: EngineServices) -> None:
        super().__init__(params, services)
        self._config = services.config
        self._model_name = services.served_model_name
        self._vocab_size = services.vocab_size

    async def handle(self, message: GenerateRequest | Abort, ctx: StageContext) -> None:
        if isinstance(message, Abort):
            await ctx.emit("out", message)
            return
        error = validate_request(message, self._config, self._model_name, self._vocab_size)
        if error is None:
            await ctx.emit("out", ValidRequest(message))
        else:
            await ctx.emit("errors", error)
