"""The ingress deployment: flowllm's own Litestar app, served by Ray Serve's HTTP proxy.

It is the app `flowllm serve` runs (`create_app`), over a `RoutedEngine` instead of a
local graph, so routes, validation errors, the API key and the 503s are the same. Beneath
it run the fronts of the placed graph, one per engine replica: admission, validation,
tokenization and detokenization happen here, as in a front process of a single server,
and only the step loop's traffic crosses to the replicas' cores. The app is built in the
replica (Serve's late-bound ingress), where the tokenizer loads.

Serve's proxy gives every request an X-Request-Id (the client's, or one it makes) before
the app sees it, and appends that id to the response itself: the app, which echoes the
same id, leaves the header to the proxy (`WithoutEchoedRequestId`), so it appears once.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from ray import serve

from flowllm.scale_out.routed_engine import RoutedEngine
from flowllm.serve_flags import auto_tool_parser, cors_config, resolve_api_key


class WithoutEchoedRequestId:
    """`app` without the X-Request-Id response header (Serve's proxy adds it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await self.app(scope, receive, send)
            return

        async def send_without_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_without_id)


@serve.ingress()
class Ingress:
    """`args`: `flowllm serve`'s; `replicas`: (deployment name, handle, token) of each
    engine replica (Serve passes handles for the bound deployments)."""

    def __init__(self, args: argparse.Namespace, replicas: Sequence[tuple[str, Any, str]]) -> None:
        self._args = args
        self._replicas = list(replicas)
        self._engine: RoutedEngine | None = None  # while the app's lifespan runs it

    async def drain(self) -> None:
        """The launcher's first step of a stop (`RoutedEngine.drain`, for up to
        --shutdown-timeout), before it deletes the application."""
        if self._engine is not None:
            await self._engine.drain(self._args.shutdown_timeout)

    def __serve_build_asgi_app__(self) -> WithoutEchoedRequestId:
        from flowllm.api.app import create_app
        from flowllm.engine import graph_for_task
        from flowllm.engine.args import config_from_args
        from flowllm.graph.validator import load_graph
        from flowllm.logging_config import configure_logging
        from flowllm.models.tokenizer import load_tokenizer, tokenizer_source

        args = self._args
        configure_logging(fmt=args.log_format, level=args.log_level, force=True)
        config = config_from_args(args)
        graph = load_graph(
            args.graph or graph_for_task(args.task, args.speculative_config is not None)
        )
        tokenizer = load_tokenizer(*tokenizer_source(config))
        replicas = self._replicas

        @asynccontextmanager
        async def engine() -> AsyncIterator[RoutedEngine]:
            async with RoutedEngine.start(
                replicas,
                config=config,
                graph=graph,
                routing=args.routing,
                imbalance_bound=args.routing_imbalance_bound,
                tokenizer=tokenizer,
                stop_timeout=args.shutdown_timeout,
            ) as routed:
                self._engine = routed
                try:
                    yield routed
                finally:
                    self._engine = None

        app = create_app(
            engine,
            api_key=resolve_api_key(args.api_key, {}),
            served_model_name=config.model.name,
            trust_request_chat_template=args.trust_request_chat_template,
            cors=cors_config(args),
            tool_call_parser=auto_tool_parser(args),
            reasoning_parser=args.reasoning_parser,
            default_chat_template_kwargs=args.default_chat_template_kwargs,
            metrics_prefix=args.metrics_prefix,
            log_requests=args.log_requests,
            ui=not args.disable_ui,
        )
        return WithoutEchoedRequestId(app)
