"""The Litestar app: OpenAI-compatible routes over a running graph (`EngineClient`).

The lifespan enters the engine's async context manager (in production it starts the stage
graph) and hangs the engine on `app.state.engine`; routes reach it through the app state.

The HTTP boundary (`HttpBoundary`) gives every request an id, asks for the API key on
every route but `PUBLIC_PATHS` (as vLLM does), and takes only JSON bodies. CORS, when
configured, is Litestar's middleware in front of everything (preflights need no key).
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
import msgspec
import structlog
from litestar import Litestar, Request, Response, get, post
from litestar.config.cors import CORSConfig
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.types import ASGIApp, HTTPScope, Message, Receive, Scope, Send
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from flowllm.api.chat import ChatFormat, ChatStream
from flowllm.api.completions import CompletionFormat, CompletionStream
from flowllm.api.convert import (
    ChatReasoning,
    check_request_template,
    flatten_messages,
    prepare_chat,
    prepare_completion,
    template_kwargs,
)
from flowllm.api.errors import EXCEPTION_HANDLERS, ApiError, send_overloaded
from flowllm.api.json_depth import maybe_too_deep, nesting_depth
from flowllm.api.logprobs import TokenTexts
from flowllm.api.openapi import OPENAPI_OPT, OpenApi, openapi_document
from flowllm.api.pooling import (
    embedding_response,
    prepare_embeddings,
    prepare_scores,
    require_task,
    rerank_documents,
    rerank_response,
    score_response,
)
from flowllm.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ModelCard,
    ModelList,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from flowllm.api.serving import ClientDisconnected, EventStream, Generation, until_disconnect
from flowllm.api.tool_calls import tool_dict
from flowllm.api.ui_routes import AUTH_PATH, STATIC_PREFIX, live_feed_of
from flowllm.api.ui_routes import ROUTES as UI_ROUTES
from flowllm.engine.client import EngineClient
from flowllm.messages import Chunk, GenerateRequest
from flowllm.metrics import MetricsView
from flowllm.text.chat_prompt import ChatPrompts
from flowllm.text.chat_template import (
    DEFAULT_BUDGET,
    ChatTemplateError,
    TemplateBudget,
    check_template_kwargs,
)
from flowllm.validation import model_not_found, show_number, tools_error
from flowllm.version import __version__

if TYPE_CHECKING:
    from flowllm.tracing import RequestTracing

S = TypeVar("S")

EngineFactory = Callable[[], AbstractAsyncContextManager[EngineClient]]
RegistryGetter = Callable[[EngineClient], "CollectorRegistry | None"]

REQUEST_ID_HEADER = "x-request-id"
# Routes that answer without the API key: probes, scrapes and the API's description.
PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics", "/openapi.json", "/docs"})
PUBLIC_PREFIXES = ("/docs/",)  # the docs UI's own assets, should it serve any
# The web page and its static files: no data in them; the page asks for the key.
UI_PUBLIC_PATHS = frozenset({"/", AUTH_PATH})
UI_PUBLIC_PREFIXES = (STATIC_PREFIX,)
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_SCOPE_REQUEST_ID = "flowllm.request_id"  # the id echoed in X-Request-Id
_SCOPE_REQUEST_ID_GIVEN = "flowllm.request_id_given"  # did the client send it?
_REQUEST_LOG = structlog.get_logger("flowllm.requests")  # --enable-log-requests
# Status logged for a request whose client left before the answer (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


def _registry_of(engine: EngineClient) -> CollectorRegistry | None:
    return getattr(engine, "metrics_registry", None)


class ApiState:
    """Everything the routes share, built once the engine is up."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        served_model_name: str,
        chat_template: str | None,
        metrics_registry: RegistryGetter,
        metrics_prefix: str = "both",
        trust_request_chat_template: bool = False,
        template_budget: TemplateBudget = DEFAULT_BUDGET,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        default_chat_template_kwargs: dict[str, Any] | None = None,
        tracing: RequestTracing | None = None,
        log_requests: bool = False,
    ) -> None:
        self.engine = engine
        self.tool_call_parser = tool_call_parser  # set only with auto tool choice enabled
        self.reasoning = ChatReasoning.of(reasoning_parser, engine.tokenizer)
        self.default_template_kwargs = default_chat_template_kwargs
        self.tracing = tracing
        self.log_requests = log_requests
        self.served_model_name = served_model_name
        self.chat_template = chat_template
        source = metrics_registry(engine)
        self.metrics: CollectorRegistry | None = (
            MetricsView(source, metrics_prefix, served_model_name).registry()
            if source is not None
            else None
        )
        self.trust_request_chat_template = trust_request_chat_template
        self.chat_prompts = ChatPrompts(engine.tokenizer, template_budget)
        self.texts = TokenTexts(engine.tokenizer)
        self.encoder = msgspec.json.Encoder()
        self.created = int(time.time())
        self._decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}

    async def decode(self, body: bytes, kind: type[S]) -> S:
        """A request body as `kind`; bad JSON or a wrong shape is a 400 naming the field.

        Nesting deeper than `max_json_depth` is refused before the decoder recurses into
        it: counting brackets settles almost every body at C speed; the precise scan the
        others need runs in a worker thread, off the event loop.
        """
        max_depth = self.engine.limits.max_json_depth
        if maybe_too_deep(body, max_depth) and (
            await anyio.to_thread.run_sync(nesting_depth, body) > max_depth
        ):
            raise _too_deep(max_depth)
        decoder = self._decoders.get(kind)
        if decoder is None:
            decoder = self._decoders[kind] = msgspec.json.Decoder(kind)
        try:
            return decoder.decode(body)  # type: ignore[no-any-return]
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ApiError.from_validation(exc) from exc
        except RecursionError as exc:  # deeper than the interpreter's stack allows
            raise _too_deep(max_depth) from exc
        except UnicodeDecodeError as exc:  # msgspec checks UTF-8 as it decodes a string
            raise ApiError(
                f"Invalid JSON body: a string is not valid UTF-8 ({exc.reason} at byte "
                f"{exc.start}).",
                code="invalid_json",
            ) from exc

    def submit(
        self,
        request: Request[Any, Any, Any],
        requests: Sequence[GenerateRequest],
        *,
        operation: str,
        response_id: str,
    ) -> Generation:
        """Enter an API request's graph requests: traced and logged when asked."""
        if self.tracing is not None:
            self.tracing.bind(request.scope, requests, operation=operation, response_id=response_id)
        if self.log_requests:
            for graph_request in requests:
                _REQUEST_LOG.info(
                    "request received",
                    request_id=graph_request.request_id,
                    response_id=response_id,
                    operation=operation,
                    model=graph_request.model,
                    params=msgspec.to_builtins(graph_request.params),
                    prompt_tokens=len(graph_request.prompt_token_ids or ()),
                    prompt_chars=len(graph_request.prompt or ""),
                    messages=len(graph_request.messages or ()),
                )
        return Generation.submit(self.engine, requests)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            error = model_not_found("", model)
            raise ApiError.from_request_error(error)


def is_public(path: str) -> bool:
    """Does this path answer without the API key?"""
    return (
        path in PUBLIC_PATHS
        or path in UI_PUBLIC_PATHS
        or path.startswith(PUBLIC_PREFIXES)
        or path.startswith(UI_PUBLIC_PREFIXES)
    )


def is_json(content_type: bytes) -> bool:
    """`application/json`, with at most a UTF-8 charset parameter (any case, any spaces)."""
    media_type, *params = content_type.decode("latin-1").split(";")
    if media_type.strip().lower() != "application/json":
        return False
    for param in params:
        name, _, value = param.partition("=")
        name = name.strip().lower()
        if name and name != "charset":
            return False
        if name == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return False
    return True


class HttpBoundary(ASGIMiddleware):
    """Request ids (honour and echo X-Request-Id), the Bearer API key on every route but
    `PUBLIC_PATHS` (and CORS preflights), JSON-only bodies (415 otherwise), and the 503
    of a request the engine's admission would refuse, sent before its body is read: in a
    burst, a probe's connection waits behind those accepted before it, so each refusal
    must cost little."""

    scopes = (ScopeType.HTTP,)

    def __init__(self, api_key: str | None) -> None:
        self._api_key = api_key.encode() if api_key else None

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        given = None
        authorization = b""
        content_type = b""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                given = value.decode("latin-1")
            elif name == b"authorization":
                authorization = value
            elif name == b"content-type":
                content_type = value
        request_id = given or uuid.uuid4().hex
        scope[_SCOPE_REQUEST_ID] = request_id  # type: ignore[literal-required]
        # Every log line of this request names it, uvicorn's access line included. The
        # binding lives in the context of the server's task for this one request.
        structlog.contextvars.bind_contextvars(request_id=request_id)
        scope[_SCOPE_REQUEST_ID_GIVEN] = given is not None  # type: ignore[literal-required]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        method = cast("HTTPScope", scope)["method"]  # `scopes` admits HTTP only
        if self._api_key is not None and method != "OPTIONS" and not is_public(scope["path"]):
            scheme, _, token = authorization.partition(b" ")
            valid = scheme.lower() == b"bearer" and hmac.compare_digest(
                token.strip(), self._api_key
            )
            if not valid:
                raise ApiError(
                    "Incorrect API key provided." if authorization else "Missing API key.",
                    status_code=401,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer", "X-Request-Id": request_id},
                )
        if method in _BODY_METHODS and not is_json(content_type):
            shown = content_type.decode("latin-1") or "none"
            raise ApiError(
                f"Unsupported Media Type: request bodies must be application/json, got {shown!r}.",
                status_code=415,
                code="unsupported_media_type",
                headers={"X-Request-Id": request_id},
            )
        if method == "POST" and scope["path"] in ADMITTED_PATHS and _engine_full(scope):
            await send_overloaded(send_with_id)
            return
        await next_app(scope, receive, send_with_id)


def _engine_full(scope: Scope) -> bool:
    api: ApiState | None = scope["litestar_app"].state.get("api")
    return api is not None and api.engine.full


def _too_deep(max_depth: int) -> ApiError:
    return ApiError(
        f"Invalid JSON body: arrays and objects nest more than {max_depth} levels deep.",
        code="json_too_deep",
    )


def _state(request: Request[Any, Any, Any]) -> ApiState:
    return request.app.state.api  # type: ignore[no-any-return]


def _ids(request: Request[Any, Any, Any], prefix: str) -> tuple[str, str]:
    """(graph request id, response id): the graph's ids stay unique even when
    clients reuse an X-Request-Id, which only names the response."""
    request_id: str = request.scope.get(_SCOPE_REQUEST_ID) or uuid.uuid4().hex  # type: ignore[assignment]
    given = bool(request.scope.get(_SCOPE_REQUEST_ID_GIVEN))
    graph_id = f"{prefix}-{uuid.uuid4().hex if given else request_id}"
    return graph_id, f"{prefix}-{request_id}"


async def _respond(
    request: Request[Any, Any, Any],
    generation: Generation,
    stream: Callable[[], EventStream | None],
    whole: Callable[[list[Any]], Any],
) -> Response[Any]:
    """Wait for the first chunks (errors keep their status), then stream or collect."""
    handed_over = False
    try:
        await until_disconnect(request, generation.prime)
        response = stream()
        if response is not None:
            handed_over = True
            return response
        results = await until_disconnect(request, generation.collect)
        return Response(whole(results), status_code=200)
    except ClientDisconnected:
        return Response(b"", status_code=CLIENT_CLOSED_REQUEST)
    finally:
        if not handed_over:
            generation.close()


@post(
    "/v1/completions",
    status_code=200,
    opt={
        OPENAPI_OPT: OpenApi(
            request=CompletionRequest,
            response=CompletionResponse,
            stream=CompletionStreamResponse,
        )
    },
)
async def create_completion(request: Request[Any, Any, Any]) -> Response[Any]:
    """Create a completion (OpenAI's legacy completions API, with vLLM's extras)."""
    arrival = time.monotonic()  # the graph's clock for latency metrics
    created = int(time.time())
    api = _state(request)
    require_task(api.engine.pooler, "/v1/completions", "generate")
    body = await api.decode(await request.body(), CompletionRequest)
    graph_id, response_id = _ids(request, "cmpl")
    prepared, streaming = prepare_completion(
        body, request_id=graph_id, served_model_name=api.served_model_name, arrival_time=arrival
    )
    fmt = CompletionFormat(
        prepared,
        response_id=response_id,
        created=created,
        model=body.model or api.served_model_name,
        texts=api.texts,
    )
    generation = api.submit(
        request, prepared.requests, operation="text_completion", response_id=response_id
    )

    def stream() -> EventStream | None:
        return EventStream(CompletionStream(generation, fmt, api.encoder)) if streaming else None

    return await _respond(request, generation, stream, fmt.response)


@post(
    "/v1/chat/completions",
    status_code=200,
    opt={
        OPENAPI_OPT: OpenApi(
            request=ChatCompletionRequest,
            response=ChatCompletionResponse,
            stream=ChatCompletionStreamResponse,
        )
    },
)
async def create_chat_completion(request: Request[Any, Any, Any]) -> Response[Any]:
    """Create a chat completion (OpenAI's chat API, with vLLM's extras)."""
    arrival = time.monotonic()  # the graph's clock for latency metrics
    created = int(time.time())
    api = _state(request)
    require_task(api.engine.pooler, "/v1/chat/completions", "generate")
    body = await api.decode(await request.body(), ChatCompletionRequest)
    graph_id, response_id = _ids(request, "chatcmpl")
    prepared, streaming = prepare_chat(
        body,
        request_id=graph_id,
        served_model_name=api.served_model_name,
        arrival_time=arrival,
        chat_template=api.chat_template,
        max_logprobs=api.engine.limits.max_logprobs,
        trust_request_chat_template=api.trust_request_chat_template,
        tool_parser=api.tool_call_parser,
        reasoning=api.reasoning,
        default_template_kwargs=api.default_template_kwargs,
    )
    fmt = ChatFormat(
        prepared,
        response_id=response_id,
        created=created,
        model=body.model or api.served_model_name,
        texts=api.texts,
    )
    generation = api.submit(request, [prepared.request], operation="chat", response_id=response_id)

    def stream() -> EventStream | None:
        return EventStream(ChatStream(generation, fmt, api.encoder)) if streaming else None

    return await _respond(request, generation, stream, lambda results: fmt.response(results[0]))


async def _pooled_response(
    request: Request[Any, Any, Any],
    api: ApiState,
    requests: list[GenerateRequest],
    build: Callable[[list[Chunk]], object],
    *,
    operation: str,
    response_id: str,
) -> Response[Any]:
    """Run pooling requests to their vectors (each one chunk) and answer `build(chunks)`;
    a client that goes first gets nothing (499), and what is left is aborted however it
    ends."""
    generation = api.submit(request, requests, operation=operation, response_id=response_id)
    try:
        await until_disconnect(request, generation.prime)
        results = await until_disconnect(request, generation.collect)
    except ClientDisconnected:
        return Response(b"", status_code=CLIENT_CLOSED_REQUEST)
    finally:
        generation.close()
    return Response(build([merged[0] for merged in results]))


@post(
    "/v1/embeddings",
    status_code=200,
    opt={OPENAPI_OPT: OpenApi(request=EmbeddingRequest, response=EmbeddingResponse)},
)
async def create_embedding(request: Request[Any, Any, Any]) -> Response[Any]:
    """Create embeddings (OpenAI's embeddings API; vLLM's `normalize`)."""
    arrival = time.monotonic()
    created = int(time.time())
    api = _state(request)
    require_task(api.engine.pooler, "/v1/embeddings", "embed")
    body = await api.decode(await request.body(), EmbeddingRequest)
    api.check_model(body.model)
    graph_id, response_id = _ids(request, "embd")
    requests = prepare_embeddings(
        body,
        request_id=graph_id,
        model=api.served_model_name,
        arrival_time=arrival,
        limits=api.engine.limits,
    )
    return await _pooled_response(
        request,
        api,
        requests,
        lambda chunks: embedding_response(
            chunks,
            encode_base64=body.encoding_format == "base64",
            response_id=response_id,
            created=created,
            model=body.model or api.served_model_name,
        ),
        operation="embeddings",
        response_id=response_id,
    )


@post(
    ["/v1/score", "/score"],
    status_code=200,
    opt={OPENAPI_OPT: OpenApi(request=ScoreRequest, response=ScoreResponse, tag="vLLM")},
)
async def create_score(request: Request[Any, Any, Any]) -> Response[Any]:
    """Score text pairs (vLLM's score API): a cross-encoder's relevance, or an embedding
    model's cosine similarity."""
    arrival = time.monotonic()
    created = int(time.time())
    api = _state(request)
    require_task(api.engine.pooler, request.url.path, "embed", "score")
    body = await api.decode(await request.body(), ScoreRequest)
    api.check_model(body.model)
    graph_id, response_id = _ids(request, "score")
    plan = prepare_scores(
        body.text_1,
        body.text_2,
        api.engine.pooler,
        request_id=graph_id,
        model=api.served_model_name,
        arrival_time=arrival,
        limits=api.engine.limits,
    )
    model = body.model or api.served_model_name
    return await _pooled_response(
        request,
        api,
        plan.requests,
        lambda chunks: score_response(
            plan, chunks, response_id=response_id, created=created, model=model
        ),
        operation="score",
        response_id=response_id,
    )


@post(
    ["/v1/rerank", "/rerank", "/v2/rerank"],
    status_code=200,
    opt={OPENAPI_OPT: OpenApi(request=RerankRequest, response=RerankResponse, tag="vLLM")},
)
async def create_rerank(request: Request[Any, Any, Any]) -> Response[Any]:
    """Rank documents by relevance to a query (vLLM's rerank API, as Jina's and Cohere's)."""
    arrival = time.monotonic()
    api = _state(request)
    require_task(api.engine.pooler, request.url.path, "embed", "score")
    body = await api.decode(await request.body(), RerankRequest)
    api.check_model(body.model)
    graph_id, response_id = _ids(request, "rerank")
    documents = rerank_documents(body)
    plan = prepare_scores(
        body.query,
        documents,
        api.engine.pooler,
        request_id=graph_id,
        model=api.served_model_name,
        arrival_time=arrival,
        limits=api.engine.limits,
        names=("query", "documents"),
    )
    model = body.model or api.served_model_name
    return await _pooled_response(
        request,
        api,
        plan.requests,
        lambda chunks: rerank_response(
            body, documents, plan, chunks, response_id=response_id, model=model
        ),
        operation="rerank",
        response_id=response_id,
    )


# The paths of the routes whose requests enter the engine's admission: refused at the door
# while it is full (HttpBoundary).
ADMITTED_PATHS = frozenset(
    path
    for handler in (
        create_completion,
        create_chat_completion,
        create_embedding,
        create_score,
        create_rerank,
    )
    for path in handler.paths
)


@get("/v1/models", opt={OPENAPI_OPT: OpenApi(response=ModelList)})
async def list_models(request: Request[Any, Any, Any]) -> ModelList:
    """List the served model."""
    api = _state(request)
    card = ModelCard(
        id=api.served_model_name,
        created=api.created,
        root=api.engine.model_name,
        max_model_len=api.engine.max_model_len,
    )
    return ModelList(data=[card])


@get("/health", opt={OPENAPI_OPT: OpenApi(media_type="text/plain", tag="Server")})
async def health(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Health: 200 while the engine runs, 503 when it failed. Needs no API key. An engine
    of several replicas that serves with some down says so in the body."""
    engine = _state(request).engine
    if not engine.healthy:
        raise ApiError("The engine is unhealthy.", status_code=503, code="engine_unhealthy")
    detail: str = getattr(engine, "health_detail", "")
    return Response(detail.encode(), status_code=200, media_type="text/plain")


@get("/version", opt={OPENAPI_OPT: OpenApi(response=VersionResponse, tag="Server")})
async def version() -> VersionResponse:
    """flowllm's version. Needs no API key."""
    return VersionResponse(version=__version__)


@get("/metrics", opt={OPENAPI_OPT: OpenApi(media_type="text/plain", tag="Server")})
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Prometheus metrics (`flowllm:` and `vllm:` names, by --metrics-prefix). Needs no
    API key."""
    api = _state(request)
    refresh = getattr(api.engine, "refresh_metrics", None)  # an engine in processes
    if refresh is not None:
        await refresh()
    registry = api.metrics
    body = generate_latest(registry) if registry is not None else b""
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _tokenize(api: ApiState, req: TokenizeRequest, kwargs: dict[str, Any] | None) -> list[int]:
    tokenizer = api.engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise ApiError("Give exactly one of prompt and messages.", param="prompt")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        return list(tokenizer.encode(req.prompt, add_special_tokens=add_special))
    tools = tuple(tool_dict(t) for t in req.tools) if req.tools else None
    error = tools_error(tools, api.engine.limits)
    if error is not None:
        raise ApiError.from_request_error(error)
    try:
        # As prepare_chat hands a chat request to the graph, and its tokenize renders it.
        text = api.chat_prompts.text(
            flatten_messages(req.messages or []),
            tools=tools,
            chat_template=req.chat_template if req.chat_template is not None else api.chat_template,
            add_generation_prompt=(
                True if req.add_generation_prompt is None else req.add_generation_prompt
            ),
            template_kwargs=kwargs,
        )
    except ChatTemplateError as e:
        raise ApiError(e.message, param=e.param, code=e.code) from e
    add_special = False if req.add_special_tokens is None else req.add_special_tokens
    return list(tokenizer.encode(text, add_special_tokens=add_special))


@post(
    "/tokenize",
    status_code=200,
    opt={OPENAPI_OPT: OpenApi(request=TokenizeRequest, response=TokenizeResponse, tag="vLLM")},
)
async def tokenize(request: Request[Any, Any, Any]) -> TokenizeResponse:
    """Token ids of a prompt, or of chat messages rendered with the chat template."""
    api = _state(request)
    req = await api.decode(await request.body(), TokenizeRequest)
    api.check_model(req.model)
    check_request_template(req.chat_template, api.trust_request_chat_template)
    kwargs = template_kwargs(req.chat_template_kwargs, api.default_template_kwargs)
    try:
        check_template_kwargs(kwargs, api.engine.limits)
    except ChatTemplateError as e:
        raise ApiError(e.message, param=e.param, code=e.code) from e
    tokens = await anyio.to_thread.run_sync(_tokenize, api, req, kwargs)
    return TokenizeResponse(
        count=len(tokens), max_model_len=api.engine.max_model_len, tokens=tokens
    )


@post(
    "/detokenize",
    status_code=200,
    opt={OPENAPI_OPT: OpenApi(request=DetokenizeRequest, response=DetokenizeResponse, tag="vLLM")},
)
async def detokenize(request: Request[Any, Any, Any]) -> DetokenizeResponse:
    """The text of token ids."""
    api = _state(request)
    req = await api.decode(await request.body(), DetokenizeRequest)
    api.check_model(req.model)
    tokenizer = api.engine.tokenizer
    vocab_size = len(tokenizer)
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(
            f"Invalid 'tokens': token id {show_number(bad[0])} is out of the vocabulary "
            f"(size {vocab_size}).",
            param="tokens",
        )
    text = await anyio.to_thread.run_sync(tokenizer.decode, req.tokens)
    # transformers types decode's result `str | list[str]` (for batches); one list, one str.
    return DetokenizeResponse(prompt=text)  # type: ignore[arg-type]


@get("/openapi.json", include_in_schema=False)
async def openapi_json(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(request.app.state.openapi_json, media_type="application/json")


_SWAGGER = SwaggerRenderPlugin(path="/docs")


@get("/docs", include_in_schema=False)
async def docs(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Litestar's Swagger UI page over the document (its scripts load from jsDelivr)."""
    html = _SWAGGER.render(request, request.app.state.openapi)
    return Response(html, media_type="text/html")


def _tracing_middleware(tracing: RequestTracing | None) -> list[ASGIMiddleware]:
    if tracing is None:
        return []
    from flowllm.tracing import TracingMiddleware

    return [TracingMiddleware(tracing)]


def create_app(
    engine_factory: EngineFactory,
    *,
    api_key: str | None = None,
    served_model_name: str,
    chat_template: str | None = None,
    metrics_registry: RegistryGetter | None = None,
    metrics_prefix: str = "both",
    trust_request_chat_template: bool = False,
    template_budget: TemplateBudget = DEFAULT_BUDGET,
    cors: CORSConfig | None = None,
    ui: bool = True,
    debug: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    default_chat_template_kwargs: dict[str, Any] | None = None,
    tracing: RequestTracing | None = None,
    log_requests: bool = False,
) -> Litestar:
    """The OpenAI-compatible app over the engine that `engine_factory()` runs.

    `chat_template`: template text for chat requests that bring none; None (the usual
    case) leaves it to the tokenizer's own template, which the loader already replaced
    with --chat-template when one was given. `metrics_registry(engine)` gives the registry
    /metrics renders (default: `engine.metrics_registry`), under the names `metrics_prefix`
    chooses (flowllm.metrics.MetricsView). `api_key`: the Bearer key every
    route but PUBLIC_PATHS asks for. `trust_request_chat_template`: accept `chat_template`
    in requests (rendered within `template_budget`). `cors`: Litestar's CORS settings;
    None sends no CORS headers. `tool_call_parser`: how `tool_choice: auto` outputs are
    read (flowllm.api.tool_calls); None refuses `auto`. `reasoning_parser`: splits chat
    outputs' thinking into `reasoning_content` (flowllm.text.reasoning).
    `default_chat_template_kwargs`: template variables every chat renders with, unless
    the request gives its own.
    `tracing`: OpenTelemetry traces of every request (flowllm.tracing); `log_requests`:
    one log line per graph request. `ui`: serve the web page at
    `/` and the data it reads under `/ui/` (flowllm/ui).
    """
    registry = metrics_registry or _registry_of

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        async with engine_factory() as engine:
            app.state.engine = engine
            app.state.api = ApiState(
                engine,
                served_model_name=served_model_name,
                chat_template=chat_template,
                metrics_registry=registry,
                metrics_prefix=metrics_prefix,
                trust_request_chat_template=trust_request_chat_template,
                template_budget=template_budget,
                tool_call_parser=tool_call_parser,
                reasoning_parser=reasoning_parser,
                default_chat_template_kwargs=default_chat_template_kwargs,
                tracing=tracing,
                log_requests=log_requests,
            )
            app.state.live_feed = live_feed_of(engine) if ui else None
            try:
                yield
            finally:
                del app.state.live_feed
                del app.state.api
                del app.state.engine

    app = Litestar(
        route_handlers=[
            create_completion,
            create_chat_completion,
            create_embedding,
            create_score,
            create_rerank,
            list_models,
            health,
            version,
            metrics,
            tokenize,
            detokenize,
            openapi_json,
            docs,
            *(UI_ROUTES if ui else ()),
        ],
        lifespan=[lifespan],
        middleware=[*_tracing_middleware(tracing), HttpBoundary(api_key)],
        exception_handlers=EXCEPTION_HANDLERS,
        openapi_config=None,  # the document comes from flowllm.api.openapi
        cors_config=cors,
        debug=debug,
        logging_config=None,  # the process's logging is configure_logging's (structlog)
    )
    app.state.api_key_required = api_key is not None
    app.state.openapi = openapi_document(
        app,
        title="flowllm",
        version=__version__,
        public=is_public,
        api_key=api_key is not None,
    )
    app.state.openapi_json = msgspec.json.encode(app.state.openapi)
    return app
