"""`flowllm serve` and `flowllm generate`: the engine behind HTTP, or one prompt offline."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import structlog

from flowllm import collector
from flowllm.config import TOOL_CALL_PARSERS, ConfigError
from flowllm.engine import DEFAULT_GRAPH, graph_for_task
from flowllm.graph.problems import GraphValidationError
from flowllm.logging_config import configure_logging
from flowllm.serve_flags import (
    ServeError,
    auto_tool_parser,
    cors_config,
    default_template_kwargs,
    exposure_warning,
    resolve_api_key,
    resolve_served_task,
)
from flowllm.text.reasoning import REASONING_PARSERS


def serving_threads(
    requested: int | None, cpu_count: int | None, env: dict[str, str], *, placed: bool = False
) -> int | None:
    """Torch's intra-op CPU threads for `flowllm serve`, unless asked: every core for an
    engine core of its own (`placed`), all cores but one when the model shares its process
    with the HTTP server.

    A server's event loop (HTTP, tokenize, detokenize, deliver) beside the model's threads
    in one process needs a core of its own, or the two preempt each other every step
    (benchmarks/README.md, "Serving: flowllm vs transformers serve"). None: leave torch's
    setting (OMP_NUM_THREADS chose it)."""
    if requested is not None:
        return max(1, requested)
    if "OMP_NUM_THREADS" in env:
        return None
    return max(1, (cpu_count or 1) - (0 if placed else 1))


def default_api_server_count(cpu_count: int | None, gpu: bool) -> int:
    """Fronts when `--api-server-count` is not given. One on a CPU, where the engine core
    needs the cores; on a GPU one per four host cores, up to four: a GPU's step yields
    tokens faster than one front's event loop streams them at high concurrency
    (benchmarks/README.md, "Serving on a GPU: how many fronts")."""
    if not gpu:
        return 1
    return max(1, min(4, (cpu_count or 1) // 4))


def gpu_present(env: dict[str, str]) -> bool:
    """Whether the engine core will find a CUDA device, judged without importing torch
    (the supervisor stays free of it to start fast): torch is a CUDA build, an NVIDIA
    driver's device node exists, and CUDA_VISIBLE_DEVICES does not hide every device."""
    if env.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return False
    if not os.path.exists("/dev/nvidiactl"):
        return False
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    version = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = version.read_text()
    except OSError:
        return False
    return re.search(r"^cuda\b[^=]*=\s*['\"]", text, re.MULTILINE) is not None


def json_list(text: str) -> list[str]:
    """A flag's JSON list of strings, as vLLM takes them: '["https://a.example"]'."""
    bad = argparse.ArgumentTypeError(
        f"""expected a JSON list of strings such as '["https://a.example"]', got {text!r}"""
    )
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad
    return value


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object, as vLLM takes them: '{"enable_thinking": false}'."""
    bad = argparse.ArgumentTypeError(
        f"""expected a JSON object such as '{{"enable_thinking": false}}', got {text!r}"""
    )
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad from e
    if not isinstance(value, dict):
        raise bad
    return value


def ssl_settings(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's TLS settings from vLLM's flags ({} without --ssl-certfile)."""
    keyfile, certfile = args.ssl_keyfile, args.ssl_certfile
    if keyfile is None and certfile is None:
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs != ssl.CERT_NONE:
            raise ServeError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")
        return {}
    if certfile is None:
        raise ServeError("--ssl-keyfile needs --ssl-certfile")
    for flag, path in (
        ("--ssl-certfile", certfile),
        ("--ssl-keyfile", keyfile),
        ("--ssl-ca-certs", args.ssl_ca_certs),
    ):
        if path is not None and not os.path.isfile(path):
            raise ServeError(f"{flag}: no such file: {path}")
    if args.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ServeError("--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required)")
    if args.ssl_cert_reqs != ssl.CERT_NONE and args.ssl_ca_certs is None:
        raise ServeError("--ssl-cert-reqs needs --ssl-ca-certs (the CAs of client certificates)")
    return {
        "ssl_keyfile": keyfile,
        "ssl_certfile": certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_cert_reqs": args.ssl_cert_reqs,
    }


def request_tracing(args: argparse.Namespace) -> Any:
    """The OpenTelemetry tracing --otlp-traces-endpoint asks for (None without it: nothing
    of OpenTelemetry is imported)."""
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    if endpoint is None:
        return None
    try:
        from flowllm.tracing import RequestTracing, TracingError
    except ImportError as e:
        raise ServeError(
            f"--otlp-traces-endpoint needs OpenTelemetry ({e.name} is missing): "
            "pip install 'flowllm[otel]'"
        ) from e
    try:
        return RequestTracing.to_endpoint(endpoint, max_links=args.max_num_seqs)
    except TracingError as e:
        raise ServeError(str(e)) from e


def serve_command(args: argparse.Namespace) -> int:
    """Load the model, then serve the OpenAI API until SIGINT/SIGTERM; exit 0 after a drain.

    A graph placed across processes (the default) is served by a supervisor process, an
    engine core and `--api-server-count` fronts (flowllm/cli/processes.py); an unplaced
    one in this process alone. The supervisor reads the graph's file, not its stages, so
    that it starts the processes without importing torch: they import (and validate) the
    stages, and one that finds them invalid exits with EXIT_INVALID_GRAPH, upon which the
    supervisor validates the graph itself to say why."""
    if args.distributed_executor_backend == "ray":
        from flowllm.scale_out.launch import serve_on_ray

        return serve_on_ray(args)
    if args.data_parallel_size != 1:
        print(
            "error: --data-parallel-size needs --distributed-executor-backend ray", file=sys.stderr
        )
        return 1
    from flowllm.engine.args import config_from_args
    from flowllm.engine.core import placement_of
    from flowllm.graph.spec import GraphSpec
    from flowllm.graph.validator import validate_graph
    from flowllm.models.draft import check_draft
    from flowllm.models.load_errors import ModelLoadError

    configure_logging(fmt=args.log_format, level=args.log_level, force=True, capture_stdlib=True)
    try:  # flag errors first: one line, before the model loads
        http_settings(args)
        config = config_from_args(args)
        default_template_kwargs(args, config.limits)
        task = resolve_served_task(args)
        config = config_from_args(args)
        check_draft(config, "--speculative-config")
        # a bad graph fails before the model
        spec = GraphSpec.load(args.graph or graph_for_task(task, config.speculative is not None))
        if spec.problems:
            validate_graph(spec)  # raises, naming every problem (its stages' too)
        # A recording runs the graph in one process: a trace's entries and spans are
        # matched by the identity of the messages they saw (traces/README.md).
        placed = bool(spec.placement) and not getattr(args, "trace_dir", None)
        if args.api_server_count is None:
            gpu = placed and gpu_present(dict(os.environ))
            args.api_server_count = default_api_server_count(os.cpu_count(), gpu)
        if args.api_server_count < 1:
            raise ServeError("--api-server-count must be >= 1")
        if placed:
            placement_of(spec)
        elif args.api_server_count != 1:
            raise ServeError(
                "--api-server-count needs a graph placed in a front and a core process "
                "(stages with process:, as the default graph), and no --trace-dir"
            )
        graph = None if placed else validate_graph(spec)  # one process imports the stages anyway
    except (ServeError, ConfigError, GraphValidationError, ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    threads = serving_threads(args.cpu_threads, os.cpu_count(), dict(os.environ), placed=placed)
    if graph is not None:
        return serve_in_one_process(args, config, graph, threads)
    from flowllm.cli.processes import Supervisor

    try:
        supervisor = Supervisor(args, config, spec, threads, serve_front)
    except GraphValidationError as e:  # validated to learn a stage class's on_error
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 1
    return supervisor.run()


def http_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The HTTP flags, checked (raises ServeError): key, CORS, TLS, tool parser, tracing."""
    return {
        "api_key": resolve_api_key(args.api_key, dict(os.environ)),
        "cors": cors_config(args),
        "tls": ssl_settings(args),
        "tool_parser": auto_tool_parser(args),
        "tracing": request_tracing(args),
    }


def serve_in_one_process(
    args: argparse.Namespace, config: Any, graph: Any, threads: int | None
) -> int:
    """Every stage and the HTTP server in this process (a graph without `process:`)."""
    from flowllm.engine.async_engine import AsyncEngine
    from flowllm.engine.loading import build_services
    from flowllm.models.load_errors import ModelLoadError

    collector.pause()  # until the engine runs (run_http)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    try:
        services = build_services(config)  # before binding the port: errors are one line
    except (ConfigError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    def engine(recorder: Any, span_sinks: Any) -> Any:
        return AsyncEngine.start(
            graph=graph,
            services=services,
            stop_timeout=args.shutdown_timeout,
            recorder=recorder,
            span_sinks=span_sinks,
        )

    return run_http(args, config, engine)


def serve_front(args: argparse.Namespace, listener: Any, index: int, core_address: str) -> int:
    """A front process: the HTTP server and the front's stages, the core at `core_address`."""
    collector.pause()  # until the engine runs (run_http)
    from flowllm.engine.args import config_from_args
    from flowllm.engine.core import load_graph_or_exit
    from flowllm.engine.front import FrontEngine

    configure_logging(fmt=args.log_format, level=args.log_level, force=True, capture_stdlib=True)
    structlog.contextvars.bind_contextvars(front=index)
    config = config_from_args(args)
    speculative = config.speculative is not None
    graph = load_graph_or_exit(str(args.graph or graph_for_task(args.task, speculative)))

    def engine(recorder: Any, span_sinks: Any) -> Any:
        return FrontEngine.connect(
            config,
            graph,
            core_address,
            index=index,
            stop_timeout=args.shutdown_timeout,
            span_sinks=span_sinks,
            recorder=recorder,
        )

    return run_http(args, config, engine, sockets=[listener])


def run_http(
    args: argparse.Namespace,
    config: Any,
    start_engine: Any,
    sockets: list[Any] | None = None,
) -> int:
    """Serve the OpenAI API over the engine `start_engine(recorder, span_sinks)` runs."""
    import uvicorn

    from flowllm.api.app import create_app
    from flowllm.engine.async_engine import AsyncEngine
    from flowllm.server import EXIT_ENGINE_FAILED, GracefulServer

    log = structlog.get_logger("flowllm.serve")
    settings = http_settings(args)
    tls, tracing = settings["tls"], settings["tracing"]
    warning = exposure_warning(args.host, settings["api_key"])
    if warning is not None:
        log.warning(warning)
    url = f"{'https' if tls else 'http'}://{args.host}:{args.port}"

    @asynccontextmanager
    async def engine() -> AsyncIterator[AsyncEngine]:
        recorder = None
        if getattr(args, "trace_dir", None):
            from flowllm.traces.recorder import TraceRecorder

            recorder = TraceRecorder(
                args.trace_dir, channels=args.trace_channels, max_bytes=args.trace_max_bytes
            )
        sinks = (tracing.span_sink,) if tracing is not None else ()
        async with start_engine(recorder, sinks) as running:
            collector.settle()  # paused since the process started
            log.info("flowllm serving", model=config.model.name, url=f"{url}/v1")
            server.engine = running
            async with anyio.create_task_group() as watch:
                watch.start_soon(server.exit_when_failed, running)
                yield running
                watch.cancel_scope.cancel()

    app = create_app(
        engine,
        api_key=settings["api_key"],
        served_model_name=config.model.name,
        trust_request_chat_template=args.trust_request_chat_template,
        cors=settings["cors"],
        tool_call_parser=settings["tool_parser"],
        reasoning_parser=args.reasoning_parser,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        metrics_prefix=args.metrics_prefix,
        tracing=tracing,
        log_requests=args.log_requests,
        ui=not args.disable_ui,
    )
    server = GracefulServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            log_config=None,  # uvicorn's loggers go through structlog (configure_logging)
            access_log=not args.disable_uvicorn_access_log,
            loop=args.uvicorn_loop,
            http=args.uvicorn_http,
            **tls,
        ),
        args.shutdown_timeout,
    )
    # uvicorn drains on SIGINT/SIGTERM, then raises the signal again to the handler it found
    # (a KeyboardInterrupt traceback, or death by SIGTERM): these let `serve` return 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=sockets)
    finally:
        if tracing is not None:
            tracing.shutdown()  # export what the batch processor still holds
    if server.escalated:
        return EXIT_ENGINE_FAILED
    return 0 if server.started else 1


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from flowllm.engine.args import add_engine_arguments
    from flowllm.scale_out.arguments import add_scale_out_arguments

    add_engine_arguments(parser, model_optional=True)
    parser.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="front processes (HTTP, tokenization, detokenization) sharing the port and one "
        "engine core (default: 1 on a CPU; on a GPU one per 4 host cores, up to 4; more than "
        "1 needs a graph placed in processes, as the default one)",
    )
    parser.add_argument(
        "--uvicorn-loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="uvicorn's event loop (auto: uvloop where installed)",
    )
    parser.add_argument(
        "--uvicorn-http",
        choices=("auto", "h11", "httptools"),
        default="auto",
        help="uvicorn's HTTP parser (auto: httptools where installed)",
    )
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
    parser.add_argument(
        "--api-key",
        help="require this Bearer key on every route but /health, /version, /metrics, "
        "/docs, /openapi.json and the web page's static files (or FLOWLLM_API_KEY); an "
        "empty key is an error",
    )
    parser.add_argument(
        "--disable-ui",
        action="store_true",
        help="do not serve the web page (playground, live graph view, request timeline) "
        "at / nor its data under /ui/",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept chat_template in requests (client-supplied Jinja, rendered within a "
        "time and size budget); refused with a 400 otherwise (chat_template_kwargs, "
        "variables for the server's template, are accepted from any client, bounded)",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        type=json_object,
        help="template variables every chat request renders with, as a JSON object (e.g. "
        """'{"enable_thinking": false}'); a request's chat_template_kwargs override them""",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split chat outputs' thinking part (<think>...</think>) into reasoning_content: "
        "qwen3 (thinking only when the output opens with <think>) or deepseek_r1 (the "
        "output starts inside the thinking part); structured outputs and tool calls then "
        "apply to the answer",
    )
    tools = parser.add_argument_group("tool calling (docs/structured-output.md)")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default when a request has tools): the model '
        "decides, and --tool-call-parser reads its calls; without it such requests get a 400",
    )
    tools.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="how to read tool calls from the output: hermes (<tool_call>{...}</tool_call>, "
        "Qwen2.5, Hermes, SmolLM and the fallback tool prompt) or llama3_json",
    )
    cors = parser.add_argument_group("CORS (off unless --allowed-origins is given)")
    cors.add_argument(
        "--allowed-origins", type=json_list, help="JSON list, e.g. '[\"https://a.example\"]'"
    )
    cors.add_argument("--allowed-methods", type=json_list, help='JSON list (default ["*"])')
    cors.add_argument("--allowed-headers", type=json_list, help='JSON list (default ["*"])')
    cors.add_argument("--allow-credentials", action="store_true", help="allow credentials")
    tls = parser.add_argument_group("HTTPS (passed to uvicorn)")
    tls.add_argument("--ssl-keyfile", help="the server's private key file (PEM)")
    tls.add_argument("--ssl-certfile", help="the server's certificate chain file (PEM)")
    tls.add_argument("--ssl-ca-certs", help="CA certificates that sign client certificates")
    tls.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        help="client certificates: 0 not asked (default), 1 optional, 2 required",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds to finish in-flight requests after SIGINT/SIGTERM",
    )
    observe = parser.add_argument_group("observability (docs/observability.md)")
    observe.add_argument(
        "--otlp-traces-endpoint",
        help="export OpenTelemetry traces of every request over OTLP/HTTP to this URL "
        "(e.g. http://localhost:4318/v1/traces); off by default",
    )
    observe.add_argument(
        "--metrics-prefix",
        choices=("both", "flowllm", "vllm"),
        default="both",
        help="/metrics names: flowllm:* and vLLM's vllm:* (with model_name) side by side "
        "(both, the default), or one of them; per-stage metrics are always flowllm:*",
    )
    requests_log = observe.add_mutually_exclusive_group()
    requests_log.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        default=False,
        help="log one line per request as it is received (off by default, as in vLLM)",
    )
    requests_log.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        help="do not log requests (the default)",
    )
    observe.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no access log line per HTTP request",
    )
    add_scale_out_arguments(parser)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    from flowllm.engine.args import add_engine_arguments

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
    from flowllm.engine.args import config_from_args
    from flowllm.graph.validator import load_graph
    from flowllm.llm import LLM
    from flowllm.mailbox import RequestFailed
    from flowllm.messages import SamplingParams
    from flowllm.models.load_errors import ModelLoadError

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
