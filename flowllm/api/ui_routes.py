"""The web page's routes: the page itself, its static files, and the data it reads.

`GET /` and `/ui/static/*` are public: static files with no data in them (the page asks
for the API key when the server wants one). The data routes need the key like the API:
`/ui/graph` (the graph's shape), `/ui/feed` (a snapshot a second over SSE, see
`flowllm.ui.live`) and `/ui/timeline/{request_id}` (a recent request's spans).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup
from litestar import Request, Response, get

from flowllm.api.errors import ApiError
from flowllm.api.serving import Emit, EventSource, EventStream
from flowllm.ui.live import FeedFull, LiveFeed

STATIC_PREFIX = "/ui/static/"
AUTH_PATH = "/ui/auth"
_MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
MAX_REQUEST_ID = 256  # characters: longer ids are never the graph's
# The page loads nothing from elsewhere and runs no inline code.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _load_static() -> dict[str, tuple[bytes, str]]:
    """The shipped files by name, read once: a name not here is a 404, never a path."""
    files: dict[str, tuple[bytes, str]] = {}
    for entry in resources.files("flowllm.ui").joinpath("static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in _MEDIA_TYPES:
            files[entry.name] = (entry.read_bytes(), _MEDIA_TYPES[suffix])
    return files


STATIC = _load_static()


def _feed(request: Request[Any, Any, Any]) -> LiveFeed:
    feed: LiveFeed | None = getattr(request.app.state, "live_feed", None)
    if feed is None:
        raise ApiError("This engine has no stage graph to show.", status_code=503, code="no_graph")
    return feed


def _static_response(name: str) -> Response[bytes]:
    found = STATIC.get(name)
    if found is None:
        raise ApiError(f"No such file: {name!r}.", status_code=404, code="not_found")
    body, media_type = found
    return Response(body, media_type=media_type, headers=_PAGE_HEADERS)


@get("/", include_in_schema=False)
async def page() -> Response[bytes]:
    """The playground, graph view and request timeline (a static page)."""
    return _static_response("index.html")


@get(f"{STATIC_PREFIX}{{name:str}}", include_in_schema=False)
async def static_file(name: str) -> Response[bytes]:
    return _static_response(name)


@get(AUTH_PATH, include_in_schema=False)
async def auth(request: Request[Any, Any, Any]) -> dict[str, bool]:
    """Whether the API wants a key, so the page asks before its first call (public: the
    OpenAPI document says as much)."""
    return {"api_key_required": bool(request.app.state.api_key_required)}


@get("/ui/graph", include_in_schema=False)
async def graph_shape(request: Request[Any, Any, Any]) -> Response[bytes]:
    """The running graph's stages and edges, as its YAML declares them."""
    return Response(msgspec.json.encode(_feed(request).shape()), media_type="application/json")


class _FeedEvents(EventSource):
    """One page's live feed: a snapshot every interval until the graph finishes."""

    def __init__(self, feed: LiveFeed) -> None:
        self.feed = feed

    async def run(self, emit: Emit, task_group: TaskGroup) -> None:
        del task_group
        feed = self.feed
        try:
            with feed.subscribe():  # held only while this body is written: never leaked
                while not feed.graph.finished:
                    await emit(b"data: " + msgspec.json.encode(await feed.snapshot()) + b"\n\n")
                    await anyio.sleep(feed.interval_s)
        except FeedFull as exc:  # lost a race for the last slot after the check below
            await emit(b"event: error\ndata: " + msgspec.json.encode(str(exc)) + b"\n\n")

    def close(self) -> None:
        pass


@get("/ui/feed", include_in_schema=False)
async def live_feed(request: Request[Any, Any, Any]) -> EventStream:
    """Server-sent events: one snapshot of the graph's numbers a second (429 when full)."""
    feed = _feed(request)
    if feed.full:
        raise ApiError(
            f"Too many live views are open (at most {feed.max_subscribers}); close one and retry.",
            status_code=429,
            code="too_many_live_views",
            headers={"Retry-After": "5"},
        )
    return EventStream(_FeedEvents(feed), headers={"X-Accel-Buffering": "no"})


@get("/ui/timeline", include_in_schema=False)
async def timeline_requests(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """The requests whose spans are held (those that ran while a page was open)."""
    return {"requests": _feed(request).timelines.request_ids()}


@get("/ui/timeline/{request_id:str}", include_in_schema=False)
async def timeline(request: Request[Any, Any, Any], request_id: str) -> Response[bytes]:
    """A recent request's spans as trace-event JSON, the form `flowllm trace view` writes."""
    if len(request_id) > MAX_REQUEST_ID:
        raise ApiError(f"A request id is at most {MAX_REQUEST_ID} characters.", param="request_id")
    events = _feed(request).timelines.events(request_id)
    if events is None:
        raise ApiError(
            f"No spans for request {request_id!r}: spans are kept for the last requests "
            "that ran while a page was open.",
            status_code=404,
            code="timeline_not_found",
        )
    return Response(msgspec.json.encode(events), media_type="application/json")


ROUTES = [page, static_file, auth, graph_shape, live_feed, timeline_requests, timeline]


def live_feed_of(engine: Any) -> LiveFeed | None:
    """The live view of an engine that runs a stage graph (None for one that does not)."""
    graph = getattr(engine, "graph", None)
    if graph is None:
        return None
    services = getattr(engine, "services", None)
    return LiveFeed(
        graph, getattr(services, "metrics", None), elsewhere=getattr(engine, "elsewhere", None)
    )
