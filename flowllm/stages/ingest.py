"""ingest: the one entry into the graph, for HTTP handlers and the offline API alike.

`submit_all` admits the prompts of one API request as a whole: it opens their mailboxes
and sends them on at once, or refuses them all. A request that could never be admitted
(n out of range, more prompts or choices than admission ever holds, a token budget beyond
`max_request_tokens`) raises `RequestFailed` with a 400 before anything is allocated; one
that cannot be admitted *now*, because `max_pending` choices already wait for their first
output or the first channel lacks room, raises `Overloaded`, so an overload is answered
immediately instead of queueing without bound. `abort` forgets the mailbox and sends an
`Abort` down the same path as requests, so it always reaches `schedule` after the request
it names.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import anyio
import msgspec

from flowllm.graph.stage import SourceStage, StageContext
from flowllm.mailbox import Mailbox, Overloaded, RequestFailed
from flowllm.messages import Abort, GenerateRequest
from flowllm.stages.services import EngineServices
from flowllm.validation import check_admission


class IngestParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_pending: int = 1024  # choices (prompts x n) admitted but without output yet


class Ingest(SourceStage):
    outputs = {"out": GenerateRequest | Abort}
    Params = IngestParams
    params: IngestParams
    services: EngineServices

    def __init__(self, params: IngestParams, services: EngineServices) -> None:
        super().__init__(params, services)
        self._mailboxes = services.mailboxes
        self._aborts: deque[Abort] = deque()  # aborts that found the channel full
        self._abort_ready = anyio.Event()
        self._accepting = True

    @property
    def full(self) -> bool:
        """No request, whatever it asks, could be admitted now."""
        return (
            not self._accepting
            or self._mailboxes.num_pending_choices >= self.params.max_pending
            or self.context.outbox("out").room() == 0
        )

    def submit(self, request: GenerateRequest) -> Mailbox:
        """Admit one request: its mailbox (see `submit_all`)."""
        return self.submit_all((request,))[0]

    def submit_all(self, requests: Sequence[GenerateRequest]) -> list[Mailbox]:
        """Admit requests together or not at all: their mailboxes, in order.

        Raises RequestFailed (a 400) when they could never be admitted, Overloaded (503
        with Retry-After) when they cannot be now.
        """
        ctx = self.context
        outbox = ctx.outbox("out")
        services = self.services
        error = check_admission(
            requests,
            services.config.limits,
            services.max_model_len,
            max_choices=self.params.max_pending,
            max_prompts=outbox.capacity,
        )
        if error is not None:
            raise RequestFailed(error)
        choices = sum(request.params.n for request in requests)
        if (
            not self._accepting
            or self._mailboxes.num_pending_choices + choices > self.params.max_pending
            or outbox.room() < len(requests)
        ):
            raise Overloaded()
        boxes: list[Mailbox] = []
        try:
            for request in requests:
                boxes.append(
                    self._mailboxes.open(request.request_id, request.params.n, request.arrival_time)
                )
        except BaseException:
            for box in boxes:
                self._mailboxes.close(box.request_id)
            raise
        for request in requests:  # room was checked, and nothing awaits in between
            ctx.emit_nowait("out", request)
        return boxes

    def abort(self, request_id: str) -> None:
        """Stop a request: its mailbox is dropped now, its blocks freed by schedule."""
        if self._mailboxes.close(request_id) is None:
            return  # unknown or already finished: nothing holds blocks for it
        abort = Abort(request_id)
        try:
            self.context.emit_nowait("out", abort)
        except anyio.WouldBlock:
            self._aborts.append(abort)  # never lost: run() sends it when there is room
            self._abort_ready.set()

    async def stop_intake(self) -> None:
        self._accepting = False

    async def run(self, ctx: StageContext) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._send_queued_aborts, ctx)
            await ctx.stop_requested.wait()
            tg.cancel_scope.cancel()
        while self._aborts:  # an abort queued during the stop still goes out
            await ctx.emit("out", self._aborts.popleft())

    async def _send_queued_aborts(self, ctx: StageContext) -> None:
        while True:
            await self._abort_ready.wait()
            self._abort_ready = anyio.Event()
            while self._aborts:
                await ctx.emit("out", self._aborts[0])
                self._aborts.popleft()
