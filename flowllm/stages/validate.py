"""validate: reject bad parameters before any work is spent on them.

A structured output constraint is compiled before the request goes on (in a thread, into
the grammar cache the guide stage reads; in a front process, by the engine core, which
holds the grammar engine and the guide), so an invalid schema, regex or grammar is a 400
naming its field; without a guide stage in the graph, constrained requests are refused.
"""

from __future__ import annotations

import anyio

from flowllm.graph.stage import NoParams, PerMessageStage, StageContext
from flowllm.messages import Abort, GenerateRequest, RequestError, StructuredOutputs, ValidRequest
from flowllm.sampling.grammar import GrammarError
from flowllm.stages.services import EngineServices
from flowllm.validation import constraint_error, validate_request


class Validate(PerMessageStage):
    inputs = {"in": GenerateRequest | Abort}
    outputs = {"out": ValidRequest | Abort, "errors": RequestError}

    def __init__(self, params: NoParams, services: EngineServices) -> None:
        super().__init__(params, services)
        self._services = services
        self._config = services.config
        self._model_name = services.served_model_name
        self._vocab_size = services.vocab_size

    async def handle(self, message: GenerateRequest | Abort, ctx: StageContext) -> None:
        if isinstance(message, Abort):
            await ctx.emit("out", message)
            return
        error = validate_request(
            message, self._config, self._model_name, self._vocab_size, self._services.pooler
        )
        spec = message.params.structured_outputs
        if error is None and spec is not None:
            error = await self._compile(message.request_id, spec)
        if error is None:
            await ctx.emit("out", ValidRequest(message))
        else:
            await ctx.emit("errors", error)

    async def _compile(self, request_id: str, spec: StructuredOutputs) -> RequestError | None:
        if not self._services.guided:
            return RequestError(
                request_id=request_id,
                message=f"'{spec.param}' is not supported by this server: its graph has no "
                "guide stage, which structured outputs need.",
                param=spec.param,
                code="unsupported_parameter",
            )
        check = self._services.check_constraint or self._compile_here
        return await check(request_id, spec)

    async def _compile_here(self, request_id: str, spec: StructuredOutputs) -> RequestError | None:
        grammars = self._services.grammars
        try:
            await anyio.to_thread.run_sync(lambda: grammars().compile(spec))
        except GrammarError as exc:
            return constraint_error(request_id, exc.message, exc.param)
        return None
