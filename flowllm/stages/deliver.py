"""deliver: the end of the graph. Delivers chunks and errors to the requests' mailboxes.

Delivery never blocks (a mailbox merges what its reader has not taken), so a slow client
cannot stall the graph. It also observes the per-request latency metrics, and when any
stage fails it answers every open request with a 500.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flowllm.graph.runtime import GraphStoppedError
from flowllm.graph.stage import NoParams, PerMessageStage, StageContext
from flowllm.mailbox import Mailbox
from flowllm.messages import Chunk, ErrorKind, RequestError, TextDeltas
from flowllm.stages.services import EngineServices


class Deliver(PerMessageStage):
    inputs = {"in": TextDeltas, "errors": RequestError}
    outputs = {}

    def __init__(self, params: NoParams, services: EngineServices) -> None:
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
        # previous chunk time -> requests whose previous chunk came then: most came in one
        # step together, so their inter-token latency is observed once, with its count
        previous: dict[float, int] = {}
        for chunk in message.chunks:
            box = get(chunk.request_id)
            if box is None:
                continue  # aborted: nobody reads it any more
            first = box.first_chunk_time is None
            deliver_to(box, chunk, now)
            if chunk.index == 0:
                last = box.last_chunk_time
                if last:
                    previous[last] = previous.get(last, 0) + 1
                box.last_chunk_time = now
            if first or chunk.finish_reason is not None:
                self._observe(box, chunk, first, now)
        itl = self._metrics.inter_token_latency
        for last, times in previous.items():
            itl.observe(now - last, times)

    def _observe(self, box: Mailbox, chunk: Chunk, first: bool, now: float) -> None:
        """Latency and token metrics at a choice's first and last chunk (vLLM's
        definitions: prefill from the first scheduled step to the first token, decode from
        there to the last, inference both)."""
        metrics = self._metrics
        if first:
            metrics.time_to_first_token.observe(now - box.arrival_time)
            metrics.prompt_tokens.inc(chunk.num_prompt_tokens)
        if chunk.index == 0 and chunk.scheduled_time:
            box.scheduled_time = chunk.scheduled_time
        if chunk.finish_reason is not None and chunk.index == 0:
            e2e = now - box.arrival_time
            metrics.e2e_request_latency.observe(e2e)
            metrics.request_prompt_tokens.observe(chunk.num_prompt_tokens)
            metrics.request_generation_tokens.observe(chunk.num_output_tokens)
            metrics.request_success.labels(chunk.finish_reason).inc()
            first_chunk_time = box.first_chunk_time
            if first_chunk_time is not None:
                metrics.request_decode_time.observe(now - first_chunk_time)
                if box.scheduled_time:
                    metrics.request_prefill_time.observe(first_chunk_time - box.scheduled_time)
                    metrics.request_inference_time.observe(now - box.scheduled_time)
                if chunk.num_output_tokens > 1:
                    decode_time = now - first_chunk_time
                    metrics.time_per_output_token.observe(
                        decode_time / (chunk.num_output_tokens - 1)
                    )

    async def fail_requests(self, errors: Iterable[RequestError], message: object = None) -> None:
        for error in errors:
            self._mailboxes.fail(error)

    async def fail_inflight(self, error: BaseException) -> None:
        if isinstance(error, GraphStoppedError):  # a stop, not a fault: come back later
            message = "The server is shutting down before this request finished; retry it."
            kind: ErrorKind = "unavailable"
        else:
            message = f"The engine failed: {type(error).__name__}: {error}"
            kind = "internal"
        self._mailboxes.fail_all(
            lambda request_id: RequestError(request_id=request_id, message=message, kind=kind)
        )
