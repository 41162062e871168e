"""A request's mailbox: where `format` delivers its chunks and its caller reads them.

`put` never blocks and never grows without bound per choice: while the reader is slow,
a choice's pending chunks merge into one, so a slow client costs memory proportional to
its unread text, never a stalled graph.
"""

from __future__ import annotations

import anyio

from flowllm.messages import Chunk, RequestError


class RequestFailed(Exception):
    """The graph answered the request with an error (raised to the mailbox's reader)."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


class Mailbox:
    """Chunks of one request, `num_choices` choices, read with `async for`."""

    def __init__(self, request_id: str, num_choices: int) -> None:
        self.request_id = request_id
        self._unfinished = set(range(num_choices))
        self._pending: dict[int, Chunk] = {}  # choice index -> merged unread chunk
        self._error: RequestError | None = None
        self._wakeup = anyio.Event()

    @property
    def done(self) -> bool:
        """Every choice finished or the request failed: nothing more will be put."""
        return not self._unfinished or self._error is not None

    def put(self, chunk: Chunk) -> None:
        if self.done:
            return
        pending = self._pending.get(chunk.index)
        self._pending[chunk.index] = chunk if pending is None else pending.merge(chunk)
        if chunk.finish_reason is not None:
            self._unfinished.discard(chunk.index)
        self._wakeup.set()

    def fail(self, error: RequestError) -> None:
        if self.done:
            return
        self._error = error
        self._wakeup.set()

    def __aiter__(self) -> Mailbox:
        return self

    async def __anext__(self) -> Chunk:
        while not self._pending:
            if self._error is not None:
                raise RequestFailed(self._error)
            if self.done:
                raise StopAsyncIteration
            await self._wakeup.wait()
            self._wakeup = anyio.Event()
        index = next(iter(self._pending))
        return self._pending.pop(index)
