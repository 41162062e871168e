"""format: the end of the graph. Delivers chunks and errors to the requests' mailboxes.

Delivery never blocks (a mailbox merges what its reader has not taken), so a slow client
cannot stall the graph. It also observes the per-request latency metrics, and when any
stage fails it answers every open request with a 500.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from flowllm.graph.runtime import GraphStoppedError
from flowllm.mailbox import Mailbox
from flowllm.messages import Chunk, RequestError, TextDeltas
from flowllm.stages.base import PerMessageStage, StageContext
from flowllm.stages.services import EngineServices


class Format(PerMessageStage):
    inputs = {"in": TextDeltas, "errors": RequestError}
    outputs = {}

    def __init__(self, params: Any, services: EngineServices) -> None:
        super().__init__(params, services)
        self._mailboxes = services.mailboxes
        self._metrics = services.metrics

    async def handle(self, message: TextDeltas | RequestError, ctx: StageContext) -> None:
        if isinstance(message, RequestError):
            self._mailboxes.fail(message)
            return
        mailboxes = self._mailboxes
        get, deliver_to = mailboxes.get, mailboxes.deliver_to
        now = time.monotonic()  # one clock read per step: the chunks arrived together
        for chunk in message.chunks:
            box = get(chunk.request_id)
            if box is None:
                continue  # aborted: nobody reads it any more
            first = box.first_chunk_time is None
            deliver_to(box, chunk, now)
            if first or chunk.finish_reason is not None:
                self._observe(box, chunk, first, now)

    def _observe(self, box: Mailbox, chunk: Chunk, first: bool, now: float) -> None:
        """Latency metrics at a choice's first and last chunk."""
        metrics = self._metrics
        if first:
            metrics.time_to_first_token.observe(now - box.arrival_time)
            metrics.prompt_tokens.inc(chunk.num_prompt_tokens)
        if chunk.finish_reason is not None and chunk.index == 0:
            e2e = now - box.arrival_time
            metrics.e2e_request_latency.observe(e2e)
            if chunk.num_output_tokens > 1 and box.first_chunk_time is not None:
                decode_time = now - box.first_chunk_time
                metrics.time_per_output_token.observe(decode_time / (chunk.num_output_tokens - 1))
        if box.done:
            metrics.request_success.inc()

    async def fail_requests(self, errors: Iterable[RequestError], message: Any = None) -> None:
        for error in errors:
            self._mailboxes.fail(error)

    async def fail_inflight(self, error: BaseException) -> None:
        if isinstance(error, GraphStoppedError):  # a stop, not a fault: come back later
            message, kind, status = (
                "The server is shutting down before this request finished; retry it.",
                "ServiceUnavailableError",
                503,
            )
        else:
            message = f"The engine failed: {type(error).__name__}: {error}"
            kind, status = "InternalServerError", 500
        self._mailboxes.fail_all(
            lambda request_id: RequestError(
                request_id=request_id, message=message, type=kind, status_code=status
            )
        )
