"""A request's mailbox: where `deliver` puts its chunks and its caller reads them; and
the two ways a request fails to its caller: refused at admission (`Overloaded`) or
answered with an error (`RequestFailed`).

`put` never blocks and never grows without bound per choice: while the reader is slow,
a choice's pending chunks merge into one, so a slow client costs memory proportional to
its unread text, never a stalled graph. The merge is done in batches (at the reader's next
read, or every `MERGE_BATCH` unread chunks), so each chunk is copied a bounded number of
times however long the reader lags: merging on every put copied the growing text and
token tuple each step, quadratic in a lagging request's output.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from flowllm.messages import Chunk, RequestError, merge_chunks

MERGE_BATCH = 64  # unread chunks of one choice kept apart before they merge into one


class Overloaded(Exception):
    """Admission refused: too many requests wait already. Retry after `retry_after` s."""

    def __init__(self, retry_after: float = 1.0) -> None:
        super().__init__("The server is overloaded; retry later.")
        self.retry_after = retry_after


class RequestFailed(Exception):
    """The graph answered the request with an error (raised to the mailbox's reader)."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


class Mailbox:
    """Chunks of one request, `num_choices` choices, read with `async for`."""

    def __init__(self, request_id: str, num_choices: int) -> None:
        self.request_id = request_id
        # A count, and the indices that finished: nothing here is proportional to the n a
        # request asks for, only to the choices that actually ran.
        self._num_choices = num_choices
        self._finished: set[int] = set()
        self._pending: dict[int, list[Chunk]] = {}  # choice index -> its unread chunks
        self._error: RequestError | None = None
        self._wakeup = anyio.Event()
        self._woken = False  # `_wakeup` is set (a flag: cheaper than asking the event)
        self.arrival_time = 0.0  # set by the registry; read for latency metrics
        self.first_chunk_time: float | None = None
        # Deliver's clocks for the latency metrics: when the first choice was first
        # scheduled, and when its latest chunk was delivered.
        self.scheduled_time = 0.0
        self.last_chunk_time = 0.0

    @property
    def done(self) -> bool:
        """Every choice finished or the request failed: nothing more will be put."""
        return len(self._finished) >= self._num_choices or self._error is not None

    def put(self, chunk: Chunk, now: float | None = None) -> bool:
        """Add a chunk (merged with the choice's unread one); `now`: time.monotonic().
        Returns `done`: whether nothing more will be put."""
        finished = self._finished
        if len(finished) >= self._num_choices or self._error is not None:  # done
            return True
        if self.first_chunk_time is None:
            self.first_chunk_time = time.monotonic() if now is None else now
        pending = self._pending.get(chunk.index)
        if pending is None:
            self._pending[chunk.index] = [chunk]
        else:
            pending.append(chunk)
            if len(pending) >= MERGE_BATCH:
                pending[:] = [merge_chunks(pending)]
        if not self._woken:
            self._woken = True
            self._wakeup.set()
        if chunk.finish_reason is not None:
            finished.add(chunk.index)
            return len(finished) >= self._num_choices
        return False

    def fail(self, error: RequestError) -> None:
        if self.done:
            return
        self._error = error
        self._woken = True
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
            self._woken = False
        index = next(iter(self._pending))
        return merge_chunks(self._pending.pop(index))


class Mailboxes:
    """Every open request's mailbox, by request id: ingest opens, deliver fills them.

    A request is *pending* from `open` until its first chunk (or its end). Admission
    control bounds the pending *choices* (a request with n = 4 counts 4): the sequences
    waiting to be scheduled.
    """

    def __init__(self) -> None:
        self._boxes: dict[str, Mailbox] = {}
        self._pending: dict[str, int] = {}  # request id -> its choices, until its first chunk
        self._pending_choices = 0
        # request id -> its mailbox, None once closed (the dict's own lookup: deliver calls
        # it for every chunk)
        self.get: Callable[[str], Mailbox | None] = self._boxes.get

    def __len__(self) -> int:
        return len(self._boxes)

    @property
    def num_pending(self) -> int:
        """Requests admitted that have no output yet."""
        return len(self._pending)

    @property
    def num_pending_choices(self) -> int:
        """The choices of the pending requests (what admission bounds)."""
        return self._pending_choices

    def _unpend(self, request_id: str) -> None:
        choices = self._pending.pop(request_id, None)
        if choices is not None:
            self._pending_choices -= choices

    def open(self, request_id: str, num_choices: int, arrival_time: float) -> Mailbox:
        if request_id in self._boxes:
            raise ValueError(f"request id {request_id!r} is already in flight")
        box = Mailbox(request_id, num_choices)
        box.arrival_time = arrival_time
        self._boxes[request_id] = box
        self._pending[request_id] = num_choices
        self._pending_choices += num_choices
        return box

    def deliver(self, chunk: Chunk) -> Mailbox | None:
        """Put a chunk in its request's mailbox; returns the mailbox (None if it is gone)."""
        box = self._boxes.get(chunk.request_id)
        if box is not None:
            self.deliver_to(box, chunk)
        return box

    def deliver_to(self, box: Mailbox, chunk: Chunk, now: float | None = None) -> None:
        """`deliver` for a caller that already looked the mailbox up (`get`)."""
        if box.first_chunk_time is None:
            self._unpend(chunk.request_id)
        if box.put(chunk, now):
            self._boxes.pop(chunk.request_id, None)

    def fail(self, error: RequestError) -> Mailbox | None:
        box = self.close(error.request_id)
        if box is not None:
            box.fail(error)
        return box

    def close(self, request_id: str) -> Mailbox | None:
        """Forget a request (aborted, failed); later chunks for it are dropped."""
        self._unpend(request_id)
        return self._boxes.pop(request_id, None)

    def fail_all(self, make_error: Callable[[str], RequestError]) -> None:
        """Answer every open request with an error (the graph is going down)."""
        for request_id in list(self._boxes):
            self.fail(make_error(request_id))
