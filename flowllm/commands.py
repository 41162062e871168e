"""`flowllm serve` and `flowllm generate`: the engine behind HTTP, or one prompt offline."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from flowllm.config import ConfigError
from flowllm.graph.commands import DEFAULT_GRAPH
from flowllm.graph.spans import configure_logging
from flowllm.graph.spec import GraphValidationError, load_graph

# The exit status of a server whose graph escalated a failure (sysexits' EX_SOFTWARE): the
# process manager should start it again.
EXIT_ENGINE_FAILED = 70


def serving_threads(
    requested: int | None, cpu_count: int | None, env: dict[str, str]
) -> int | None:
    """Torch's intra-op CPU threads for `flowllm serve`: all cores but one unless asked.

    The server's event loop (HTTP, tokenize, schedule, detokenize, format) needs a core of
    its own beside the model's threads. On the 2-core development machine, one torch thread
    instead of two served SmolLM2 bf16 at 25–38 vs 19 tok/s at concurrency 1 and 235–260
    vs 215 tok/s at concurrency 32 (offline batches, with no event loop to feed, keep every
    core). None: leave torch's setting (OMP_NUM_THREADS chose it)."""
    if requested is not None:
        return max(1, requested)
    if "OMP_NUM_THREADS" in env:
        return None
    return max(1, (cpu_count or 1) - 1)


def serve_command(args: argparse.Namespace) -> int:
    """Load the model, then serve the OpenAI API until SIGINT/SIGTERM; exit 0 after a drain."""
    import uvicorn

    from flowllm.api.app import create_app
    from flowllm.async_engine import AsyncEngine
    from flowllm.engine_args import config_from_args
    from flowllm.models.loader import ModelLoadError
    from flowllm.stages.services import build_services

    configure_logging(fmt=args.log_format, level=args.log_level, force=True)
    threads = serving_threads(args.cpu_threads, os.cpu_count(), dict(os.environ))
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    try:
        config = config_from_args(args)
        graph = load_graph(args.graph or DEFAULT_GRAPH)  # a bad graph fails before the model
        services = build_services(config)  # before binding the port: errors are one line
    except (ConfigError, ModelLoadError, GraphValidationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    url = f"http://{args.host}:{args.port}"
    escalated = False

    async def exit_when_failed(running: AsyncEngine) -> None:
        """An escalated failure ends the graph: stop serving, so the process exits."""
        nonlocal escalated
        await running.graph.wait_finished()
        if running.graph.failed:
            escalated = True
            print("error: the engine failed; exiting so that it can be restarted", file=sys.stderr)
            server.should_exit = True

    @asynccontextmanager
    async def engine() -> AsyncIterator[AsyncEngine]:
        recorder = None
        if getattr(args, "trace_dir", None):
            from flowllm.traces.recorder import TraceRecorder

            recorder = TraceRecorder(
                args.trace_dir, channels=args.trace_channels, max_bytes=args.trace_max_bytes
            )
        async with AsyncEngine.start(
            graph=graph,
            services=services,
            stop_timeout=args.shutdown_timeout,
            recorder=recorder,
        ) as running:
            print(f"flowllm serving {config.model.name!r} at {url}/v1", file=sys.stderr)
            async with anyio.create_task_group() as watch:
                watch.start_soon(exit_when_failed, running)
                yield running
                watch.cancel_scope.cancel()

    app = create_app(
        engine,
        api_key=args.api_key or os.environ.get("FLOWLLM_API_KEY") or None,
        served_model_name=config.model.name,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=int(args.shutdown_timeout),
        )
    )
    # uvicorn drains on SIGINT/SIGTERM, then raises the signal again to the handler it found
    # (a KeyboardInterrupt traceback, or death by SIGTERM): these let `serve` return 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    if escalated:
        return EXIT_ENGINE_FAILED
    return 0 if server.started else 1


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from flowllm.engine_args import add_engine_arguments

    add_engine_arguments(parser, model_optional=True)
    parser.add_argument(
        "--cpu-threads",
        type=int,
        help="torch's CPU threads (default: all cores but one, "
        "which the server's event loop keeps; OMP_NUM_THREADS also sets it)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine "
        "only; 0.0.0.0 serves every interface)",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", help="require this Bearer key on /v1/* (or FLOWLLM_API_KEY)")
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds to finish in-flight requests after SIGINT/SIGTERM",
    )


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    from flowllm.engine_args import add_engine_arguments

    add_engine_arguments(parser, model_optional=False, log_level="warning")
    parser.add_argument("prompt", nargs="+", help="one or more prompts")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--sampling-seed", type=int, help="per-request seed")


def generate_command(args: argparse.Namespace) -> int:
    """Generate for the prompts offline and print each choice's text."""
    from flowllm.engine_args import config_from_args
    from flowllm.llm import LLM
    from flowllm.mailbox import RequestFailed
    from flowllm.messages import SamplingParams
    from flowllm.models.loader import ModelLoadError

    configure_logging(fmt=args.log_format, level=args.log_level, force=True)
    try:
        graph = load_graph(args.graph or DEFAULT_GRAPH)  # a bad graph fails before the model
        llm = LLM(
            config=config_from_args(args),
            graph=graph,
            trace_dir=args.trace_dir,
            trace_channels=args.trace_channels,
            trace_max_bytes=args.trace_max_bytes,
        )
        params = SamplingParams(
            n=args.n,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
            seed=args.sampling_seed,
        )
        outputs = llm.generate(args.prompt, params)
    except (ConfigError, ModelLoadError, GraphValidationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RequestFailed as e:
        print(f"error: {e.error.message}", file=sys.stderr)
        return 1
    for output in outputs:
        for choice in output.outputs:
            print(f"{output.prompt}{choice.text}")
    return 0
