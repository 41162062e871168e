"""ingest: the one entry into the graph, for HTTP handlers and the offline API alike.

`submit` opens the request's mailbox and sends the request on at once, or refuses it with
`Overloaded` when `max_pending` requests already wait for their first output (or the first
channel is full), so an overload is answered immediately instead of queueing without
bound. `abort` forgets the mailbox and sends an `Abort` down the same path as requests, so
it always reaches `schedule` after the request it names.
"""

from __future__ import annotations

from collections import deque

import anyio
import msgspec

from flowllm.engine_client import Overloaded
from flowllm.mailbox import Mailbox
from flowllm.messages import Abort, GenerateRequest
from flowllm.stages.base import SourceStage, StageContext
from flowllm.stages.services import EngineServices


class IngestParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_pending: int = 1024  # requests admitted but without output yet


class Ingest(SourceStage):
    outputs = {"out": GenerateRequest | Abort}
    Params = IngestParams

    def __init__(self, params: IngestParams, services: EngineServices) -> None:
        super().__init__(params, services)
        self._mailboxes = services.mailboxes
        self._aborts: deque[Abort] = deque()  # aborts that found the channel full
        self._abort_ready = anyio.Event()
        self._accepting = True

    def submit(self, request: GenerateRequest) -> Mailbox:
        """Admit a request: its mailbox, or Overloaded (503 with Retry-After)."""
        if not self._accepting or self._mailboxes.num_pending >= self.params.max_pending:
            raise Overloaded()
        ctx = self.context
        # At least one choice: a box opened for n < 1 would count as finished at once and
        # drop the error validate sends for that n (the client would get no choices, 200).
        choices = max(request.params.n, 1)
        box = self._mailboxes.open(request.request_id, choices, request.arrival_time)
        try:
            ctx.emit_nowait("out", request)
        except anyio.WouldBlock:
            self._mailboxes.close(request.request_id)
            raise Overloaded() from None
        return box

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
