"""The HTTP side of a request's life in the graph: submit, read mailboxes, abort.

A `Generation` holds the mailboxes of one API request's sub-requests (one per prompt) and
aborts every unfinished one when it closes, whatever ended the handler: a client that
disconnected, an error in another sub-request, a bug. Non-streaming handlers wait under
`until_disconnect`; streaming responses are an `EventStream`, whose body is written by a
coroutine in the same task that closes the generation, so the abort cannot be skipped.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream
from litestar import Request
from litestar.datastructures import Cookie
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Receive, Send

from flowllm.api.errors import ApiError, overloaded
from flowllm.api.logprobs import TokenTexts
from flowllm.engine.client import EngineClient
from flowllm.mailbox import Mailbox, Overloaded, RequestFailed
from flowllm.messages import Chunk, GenerateRequest, RequestError, merge_by_choice

T = TypeVar("T")

# Writes one SSE event's bytes to the client.
Emit = Callable[[bytes], Awaitable[None]]


Prepared = TypeVar("Prepared")


class ResponseFormat(Generic[Prepared]):
    """What every response body of one request shares: the prepared request, its id, its
    creation time, the model name and the token texts for logprobs."""

    def __init__(
        self,
        prepared: Prepared,
        *,
        response_id: str,
        created: int,
        model: str,
        texts: TokenTexts,
    ) -> None:
        self.prepared = prepared
        self.response_id = response_id
        self.created = created
        self.model = model
        self.texts = texts


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


class Generation:
    """One API request's sub-requests in the graph, in prompt order."""

    def __init__(self, engine: EngineClient, mailboxes: list[Mailbox]) -> None:
        self._engine = engine
        self.mailboxes = mailboxes
        self.first_chunks: list[Chunk | None] = [None] * len(mailboxes)
        self._closed = False

    @classmethod
    def submit(cls, engine: EngineClient, requests: Sequence[GenerateRequest]) -> Generation:
        """Enter the sub-requests as a whole: admitted together, or a 503 (overloaded now)
        or the 400 of a request that could never be admitted."""
        if not engine.accepting:
            # It failed and the process is exiting (or it stops): another start will serve.
            raise ApiError(
                "The engine is not serving requests now; retry later.",
                status_code=503,
                code="engine_unavailable",
                headers={"Retry-After": "1"},
            )
        generation = cls(engine, [])
        try:
            generation.mailboxes = engine.submit_all(requests)
        except RequestFailed as failed:
            raise ApiError.from_request_error(failed.error) from failed
        except Overloaded as exc:
            raise overloaded(exc.retry_after) from exc
        generation.first_chunks = [None] * len(generation.mailboxes)
        return generation

    def close(self) -> None:
        """Abort every sub-request still running (its KV blocks are freed). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for mailbox in self.mailboxes:
            if not mailbox.done:
                self._engine.abort(mailbox.request_id)

    async def prime(self) -> None:
        """Wait for each sub-request's first chunk, so that errors the graph finds before
        generating (validation, context length) still get their HTTP status."""
        for i, mailbox in enumerate(self.mailboxes):
            try:
                self.first_chunks[i] = await mailbox.__anext__()
            except StopAsyncIteration:
                self.first_chunks[i] = None
            except RequestFailed as failed:
                raise ApiError.from_request_error(failed.error) from failed

    async def collect(self) -> list[dict[int, Chunk]]:
        """Every sub-request's output, its chunks merged per choice index."""
        results: list[dict[int, Chunk]] = []
        for i, mailbox in enumerate(self.mailboxes):
            first = self.first_chunks[i]
            chunks = [] if first is None else [first]
            try:
                chunks += [chunk async for chunk in mailbox]
            except RequestFailed as failed:
                raise ApiError.from_request_error(failed.error) from failed
            results.append(merge_by_choice(chunks))
        return results

    def start_pumps(self, task_group: TaskGroup) -> AsyncIterator[tuple[int, Chunk | RequestError]]:
        """Merge the mailboxes into one stream of (prompt index, chunk or error).

        The hand-off has no buffer: while the client is slow, the pumps wait and each
        mailbox coalesces its pending text instead of holding up the graph.
        """
        send, receive = anyio.create_memory_object_stream[tuple[int, Chunk | RequestError]](0)
        for i, mailbox in enumerate(self.mailboxes):
            task_group.start_soon(self._pump, i, mailbox, self.first_chunks[i], send.clone())
        send.close()
        return receive

    @staticmethod
    async def _pump(
        index: int,
        mailbox: Mailbox,
        first: Chunk | None,
        send: MemoryObjectSendStream[tuple[int, Chunk | RequestError]],
    ) -> None:
        async with send:
            if first is not None:
                await send.send((index, first))
            try:
                async for chunk in mailbox:
                    await send.send((index, chunk))
            except RequestFailed as failed:
                await send.send((index, failed.error))


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request[Any, Any, Any], work: Callable[[], Awaitable[T]]) -> T:
    """Run `work`, or raise ClientDisconnected as soon as the client goes away.

    The body must have been read already: from then on the only message ASGI delivers
    is the disconnect.
    """
    result: list[T] = []
    failure: list[BaseException] = []
    disconnected = False

    async def watch(scope: anyio.CancelScope) -> None:
        nonlocal disconnected
        await _wait_for_disconnect(request.receive)
        disconnected = True
        scope.cancel()

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(watch, task_group.cancel_scope)
        try:
            result.append(await work())
        except Exception as exc:  # re-raised below, unwrapped from the task group
            failure.append(exc)
        task_group.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if disconnected and not result:
        raise ClientDisconnected
    return result[0]


class EventSource(abc.ABC):
    """What an `EventStream` sends: `run` writes the events, `close` always runs after."""

    @abc.abstractmethod
    async def run(self, emit: Emit, task_group: TaskGroup) -> None:
        """Write every event with `emit`; start helper tasks in `task_group`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the stream holds (abort unfinished requests); called exactly once."""


class _ASGIEventStream(ASGIStreamingResponse):
    """Streams an EventSource; a client disconnect cancels it, and `close` runs either way."""

    __slots__ = ("source",)

    def __init__(self, *, source: EventSource, **kwargs: Any) -> None:
        super().__init__(iterator=iter(()), **kwargs)
        self.source = source

    async def send_body(self, send: Send, receive: Receive) -> None:
        async def emit(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        try:
            async with anyio.create_task_group() as task_group:

                async def watch() -> None:
                    await _wait_for_disconnect(receive)
                    task_group.cancel_scope.cancel()

                task_group.start_soon(watch)
                await self.source.run(emit, task_group)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                task_group.cancel_scope.cancel()
        finally:
            self.source.close()


class EventStream(Stream):
    """A `text/event-stream` response whose body an EventSource writes."""

    def __init__(self, source: EventSource, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(
            iter(()),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **(headers or {})},
        )
        self.source = source

    def to_asgi_response(
        self,
        app: Any,
        request: Request[Any, Any, Any],
        *,
        background: Any = None,
        cookies: Iterable[Cookie] | None = None,
        encoded_headers: Iterable[tuple[bytes, bytes]] | None = None,
        headers: dict[str, str] | None = None,
        is_head_response: bool = False,
        media_type: Any = None,
        status_code: int | None = None,
        type_encoders: Any = None,
    ) -> ASGIResponse:
        merged = {**headers, **self.headers} if headers is not None else dict(self.headers)
        all_cookies = list(self.cookies) if cookies is None else [*self.cookies, *cookies]
        return _ASGIEventStream(
            source=self.source,
            background=self.background or background,
            content_length=0,
            cookies=all_cookies,
            encoded_headers=encoded_headers,
            encoding=self.encoding,
            headers=merged,
            is_head_response=is_head_response,
            media_type="text/event-stream",
            status_code=self.status_code or status_code or 200,
        )
