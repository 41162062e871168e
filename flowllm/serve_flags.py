"""`flowllm serve`'s flags that both of its backends check the same way: the single
server (flowllm/cli/serve.py) and data-parallel serving on Ray (flowllm/scale_out/), so
that a flag means one thing, and fails with one message, whichever serves."""

from __future__ import annotations

import argparse
import ipaddress
from typing import Any


class ServeError(ValueError):
    """A serve flag that cannot work; `flowllm serve` prints it as one line and exits 1."""


def resolve_api_key(flag: str | None, env: dict[str, str]) -> str | None:
    """The key from --api-key, else FLOWLLM_API_KEY; None when neither is set. An empty
    key is an error: it would otherwise mean "no auth" without saying so."""
    key = flag if flag is not None else env.get("FLOWLLM_API_KEY")
    if key is not None and not key.strip():
        source = "--api-key" if flag is not None else "FLOWLLM_API_KEY"
        raise ServeError(f"{source} is empty: give a key, or leave it unset to serve without one")
    return key


def is_loopback(host: str) -> bool:
    """Only this machine can reach `host` (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to warn about when the server is reachable from other machines without a key."""
    if api_key is not None or is_loopback(host):
        return None
    return (
        f"serving on {host} without --api-key: anyone who can reach this port can use the "
        "model (set --api-key or FLOWLLM_API_KEY, or bind 127.0.0.1; see SECURITY.md)"
    )


def default_template_kwargs(args: argparse.Namespace, limits: Any) -> dict[str, Any] | None:
    """--default-chat-template-kwargs, held to what a request's own may be (raises
    ServeError): a request that overrides none of them would otherwise be refused."""
    from flowllm.text.chat_template import ChatTemplateError, check_template_kwargs

    kwargs: dict[str, Any] | None = getattr(args, "default_chat_template_kwargs", None)
    try:
        check_template_kwargs(kwargs, limits)
    except ChatTemplateError as e:
        raise ServeError(f"--default-chat-template-kwargs: {e.message}") from e
    return kwargs


def cors_config(args: argparse.Namespace) -> Any:
    """Litestar's CORS settings from vLLM's flags; None (no CORS headers) without
    --allowed-origins."""
    origins = getattr(args, "allowed_origins", None)
    if origins is None:
        others = [
            flag
            for flag, value in (
                ("--allowed-methods", args.allowed_methods),
                ("--allowed-headers", args.allowed_headers),
                ("--allow-credentials", args.allow_credentials or None),
            )
            if value is not None
        ]
        if others:
            raise ServeError(f"{', '.join(others)} needs --allowed-origins (CORS is off)")
        return None
    # imported here: litestar is the fronts', and the supervisor checks this flag too
    # (benchmarks/README.md, "Start-up")
    from litestar.config.cors import CORSConfig

    return CORSConfig(
        allow_origins=origins,
        allow_methods=args.allowed_methods or ["*"],
        allow_headers=args.allowed_headers or ["*"],
        allow_credentials=bool(args.allow_credentials),
    )


def resolve_served_task(args: argparse.Namespace) -> str:
    """`--task` as the checkpoint resolves it (`auto`: what it is for), read without
    torch, and set on `args`, from which the core and the fronts build their configs.
    Resolving the model converts the bundled one once, here."""
    from flowllm.models.loader import resolve_model
    from flowllm.models.pooler_config import resolve_task

    resolved = resolve_model(args.model, args.quantization)
    args.task = resolve_task(resolved.path, args.task, from_gguf=resolved.config_from_gguf)
    return str(args.task)


def auto_tool_parser(args: argparse.Namespace) -> str | None:
    """The parser that reads `tool_choice: auto` outputs, or None when auto is off."""
    if not args.enable_auto_tool_choice:
        return None
    if args.tool_call_parser is None:
        raise ServeError("--enable-auto-tool-choice needs --tool-call-parser")
    return str(args.tool_call_parser)
