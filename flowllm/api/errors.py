"""Every failure as OpenAI's error body `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `ApiError`; Litestar's exception handlers below turn it, the framework's
own exceptions (unknown route, wrong method) and anything unexpected into that body, so
a client never sees a framework default page.
"""

from __future__ import annotations

import math
import re
from http import HTTPStatus
from typing import Any

import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap, Send

from flowllm.api.protocol import UNSUPPORTED_FIELDS, ErrorInfo, ErrorResponse
from flowllm.messages import ErrorKind, RequestError

# The error `type` for each status, following vLLM's names.
STATUS_OF_KIND: dict[ErrorKind, int] = {
    "invalid_request": 400,
    "not_found": 404,
    "unavailable": 503,
    "internal": 500,
}
_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}

# msgspec's validation messages end with the JSON path of the bad value, e.g. "at `$.n`"
# or "at `key` in `$.logit_bias`"; the top-level field is the OpenAI `param`.
_PATH = re.compile(r"`\$\.([A-Za-z_][A-Za-z0-9_]*)")
# "Object contains unknown field `tools` - at `$.messages[0]`" (no path at the top level).
_UNKNOWN = re.compile(r"unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")


class ApiError(Exception):
    """A request the API refuses; becomes the OpenAI error body with `status_code`."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type or error_type(status_code)
        self.param = param
        self.code = code
        self.headers = headers or {}

    @classmethod
    def from_request_error(cls, error: RequestError) -> ApiError:
        status = STATUS_OF_KIND[error.kind]
        return cls(
            error.message,
            status_code=status,
            param=error.param,
            code=error.code,
            # The graph answers 503 to work a stop cut short: the client should come back.
            headers={"Retry-After": "1"} if status == 503 else None,
        )

    @classmethod
    def from_validation(cls, exc: msgspec.ValidationError | msgspec.DecodeError) -> ApiError:
        """A body that is not JSON, or JSON of the wrong shape: 400 naming the field."""
        if not isinstance(exc, msgspec.ValidationError):
            return cls(f"Invalid JSON body: {exc}", code="invalid_json")
        unknown = _UNKNOWN.search(str(exc))
        if unknown is not None:
            return cls.unknown_field(unknown.group(1), unknown.group(2) or "")
        match = _PATH.search(str(exc))
        param = match.group(1) if match else None
        if param is None and "missing required field" in str(exc):
            param = str(exc).split("`")[1] if "`" in str(exc) else None
        return cls(f"Invalid request: {exc}", param=param, code="invalid_type")

    @classmethod
    def unsupported(cls, param: str, feature: str) -> ApiError:
        """A field asking for a feature OpenAI or vLLM has and this server does not."""
        return cls(
            f"Invalid '{param}': {feature} is not supported by this server.",
            param=param,
            code="unsupported_parameter",
        )

    @classmethod
    def unknown_field(cls, name: str, path: str) -> ApiError:
        """A field the request struct does not declare: unsupported (a feature OpenAI or
        vLLM has and this server does not) or unrecognized; `param` names it."""
        param = f"{path}.{name}" if path else name
        if len(param) > 100:
            param = param[:100] + "..."
        feature = UNSUPPORTED_FIELDS.get(name) if not path else None
        if feature is not None:
            return cls.unsupported(param, feature)
        return cls(
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)


def error_type(status_code: int) -> str:
    if status_code in _TYPES:
        return _TYPES[status_code]
    return "InternalServerError" if status_code >= 500 else "BadRequestError"


def overloaded(retry_after: float = 1.0) -> ApiError:
    """Admission is full now: 503, come back in `retry_after` seconds (at least one)."""
    return ApiError(
        "The server is overloaded; retry later.",
        status_code=503,
        code="server_overloaded",
        headers={"Retry-After": str(max(1, math.ceil(retry_after)))},
    )


_OVERLOADED = overloaded()
_OVERLOADED_BODY = msgspec.json.encode(ErrorResponse(error=_OVERLOADED.info()))
_OVERLOADED_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(_OVERLOADED_BODY)).encode()),
    *((name.lower().encode(), value.encode()) for name, value in _OVERLOADED.headers.items()),
]


async def send_overloaded(send: Send) -> None:
    """`overloaded()`'s response, sent as raw ASGI messages: the cheapest refusal there is."""
    await send(
        {"type": "http.response.start", "status": 503, "headers": list(_OVERLOADED_HEADERS)}
    )
    await send({"type": "http.response.body", "body": _OVERLOADED_BODY, "more_body": False})


def error_response(error: ApiError) -> Response[ErrorResponse]:
    return Response(
        ErrorResponse(error=error.info()),
        status_code=error.status_code,
        headers=error.headers,
        media_type="application/json",
    )


def handle_api_error(_: Request[Any, Any, Any], exc: ApiError) -> Response[ErrorResponse]:
    return error_response(exc)


def handle_http_exception(
    request: Request[Any, Any, Any], exc: HTTPException
) -> Response[ErrorResponse]:
    """Litestar's own errors (404 route, 405 method, 413 body size) in OpenAI's shape."""
    status = exc.status_code
    message = exc.detail or HTTPStatus(status).phrase
    if status in (404, 405):
        message = f"{message}: {request.method} {request.url.path}"
    headers = dict(exc.headers or {})
    return error_response(ApiError(message, status_code=status, headers=headers))


def handle_unexpected(_: Request[Any, Any, Any], exc: Exception) -> Response[ErrorResponse]:
    """A bug: log it with its traceback, answer 500 without leaking internals."""
    structlog.get_logger("flowllm.api").exception("unhandled error in request handler")
    return error_response(ApiError(f"Internal server error: {type(exc).__name__}", status_code=500))


EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    ApiError: handle_api_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
