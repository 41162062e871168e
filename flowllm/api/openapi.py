"""The OpenAPI 3.1 document of the app, generated from its routes and the protocol Structs.

Every route handler says what it takes and gives in its `opt` (`OpenApi`): the request
body Struct, the response Struct, the streamed chunk Struct, the media type. The document
walks `app.routes`, so every endpoint appears, and its schemas are msgspec's JSON Schema
of those Structs (`msgspec.json.schema_components`): nothing is written by hand, so the
document cannot drift from what the server decodes and encodes. Handlers decode bodies
themselves (errors stay OpenAI's 400 naming the field), so Litestar's own OpenAPI
generation, which reads handler signatures, is not used; its Swagger UI page is (`/docs`).
"""

from __future__ import annotations

import inspect
from typing import Any

import msgspec
from litestar import Litestar
from litestar.routes import HTTPRoute

from flowllm.api.protocol import ErrorResponse

OPENAPI_OPT = "openapi"
REF_TEMPLATE = "#/components/schemas/{name}"


class OpenApi(msgspec.Struct, frozen=True, kw_only=True):
    """What a route handler documents (kept in the handler's `opt["openapi"]`)."""

    request: Any = None  # the JSON body's Struct, None: no body
    response: Any = None  # the 200 JSON body's Struct, None: see media_type
    stream: Any = None  # the Struct of each SSE `data:` line when the request streams
    media_type: str = "application/json"  # of the 200 response
    tag: str = "OpenAI"


def _summary(fn: Any) -> tuple[str | None, str | None]:
    doc = inspect.getdoc(fn)
    if not doc:
        return None, None
    first, _, rest = doc.partition("\n\n")
    return " ".join(first.split()), rest.strip() or None


def openapi_document(
    app: Litestar,
    *,
    title: str,
    version: str,
    public: Any,
    api_key: bool,
) -> dict[str, Any]:
    """The OpenAPI document for `app`'s routes. `public(path)`: answers without the key;
    `api_key`: the server asks for one (operations then list the bearer scheme)."""
    operations: list[tuple[str, str, Any, OpenApi]] = []
    types: list[Any] = [ErrorResponse]
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for verb, (handler, _) in sorted(route.route_handler_map.items()):
            if verb in ("OPTIONS", "HEAD") or not handler.include_in_schema:
                continue
            spec = handler.opt.get(OPENAPI_OPT) or OpenApi()
            operations.append((route.path, verb.lower(), handler, spec))
            types.extend(t for t in (spec.request, spec.response, spec.stream) if t is not None)
    unique = list(dict.fromkeys(types))
    schemas, components = msgspec.json.schema_components(unique, ref_template=REF_TEMPLATE)
    schema_of = dict(zip(unique, schemas, strict=True))
    error = {"application/json": {"schema": schema_of[ErrorResponse]}}

    paths: dict[str, dict[str, Any]] = {}
    for path, method, handler, spec in operations:
        summary, description = _summary(handler.fn)
        content: dict[str, Any] = {}
        if spec.response is not None:
            content[spec.media_type] = {"schema": schema_of[spec.response]}
        elif spec.media_type != "application/json":
            content[spec.media_type] = {"schema": {"type": "string"}}
        if spec.stream is not None:
            content["text/event-stream"] = {
                "schema": schema_of[spec.stream],
                "description": "With `stream: true`: server-sent events, each `data:` line "
                "one chunk of this shape; the last is `data: [DONE]`.",
            }
        responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
        if spec.request is not None:
            responses["400"] = {"description": "Invalid request", "content": error}
            responses["415"] = {"description": "The body is not JSON", "content": error}
        needs_key = api_key and not public(path)
        if needs_key:
            responses["401"] = {"description": "Missing or wrong API key", "content": error}
        responses["default"] = {"description": "Error", "content": error}
        operation: dict[str, Any] = {
            "operationId": handler.handler_name,
            "tags": [spec.tag],
            "responses": responses,
        }
        if summary:
            operation["summary"] = summary
        if description:
            operation["description"] = description
        if spec.request is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": schema_of[spec.request]}},
            }
        if needs_key:
            operation["security"] = [{"bearer": []}]
        paths.setdefault(path, {})[method] = operation

    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "--api-key"}
        }
    return document
