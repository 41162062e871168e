"""The OpenAI-compatible HTTP API on Litestar.

- protocol.py: request and response bodies (msgspec Structs), OpenAI's shapes exactly
- convert.py: request bodies -> `GenerateRequest`s (one per prompt) with the API defaults
- serving.py: submit, read mailboxes, stream SSE, abort what a departed client left running
- completions.py, chat.py: chunks -> OpenAI choices, whole or streamed
- logprobs.py: token strings and the two logprobs shapes
- errors.py: every failure as `{"error": {"message", "type", "param", "code"}}`
- openapi.py: the OpenAPI document, from the routes and the protocol Structs
- app.py: `create_app`, the routes and the HTTP boundary (request ids, API key, JSON only)
"""

from __future__ import annotations

from flowllm.api.app import create_app

__all__ = ["create_app"]
