"""`flowllm serve --distributed-executor-backend ray`: the application on a Ray cluster.

Starts a Ray cluster on this machine (or joins `--ray-address`), runs Serve's HTTP proxy
on --host/--port, and deploys one application: the ingress (the API and one front of the
placed graph per replica) and `--data-parallel-size` engine replicas, each an engine core
and a Serve deployment of its own, so that the ingress's front for it finds it (and
labels its metrics with it). Each replica gets a token of its own, which its front's
greeting must carry: the core's TCP port serves that front and nobody else. SIGINT or
SIGTERM stops the application (the requests in flight finish for up to
--shutdown-timeout, through the proxy; those still running then get a 503, as on a single
server), then Serve and Ray: a cluster this command started leaves no process behind.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import secrets
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from flowllm.serve_flags import (
    ServeError,
    auto_tool_parser,
    cors_config,
    default_template_kwargs,
    exposure_warning,
    resolve_api_key,
    resolve_served_task,
)
from flowllm.validation import show_number

APP_NAME = "flowllm"
INGRESS_NAME = "ingress"
# Requests Serve lets a deployment hold at once; flowllm's admission (503s) is the bound
# that matters, so Serve's own must be above it and never queue what admission would take.
MAX_ONGOING_REQUESTS = 4096
# Ray CPUs the ingress reserves: it is the front of every replica (HTTP, tokenization,
# detokenization), so a cluster must not pack replicas onto the core it works on.
INGRESS_CPUS = 1.0
HEALTH_CHECK_PERIOD_S = 2.0
# How often a stopping replica looks for requests still running (Serve's default: 2 s).
# Serve sleeps this long before its first look even when none runs, and an idle server
# waits for it; shorter costs a counter read, and a log line while requests drain.
SHUTDOWN_POLL_S = 0.2
# Past the replicas' drains, time for Serve to stop them before `serve.shutdown` takes
# what is left.
SHUTDOWN_GRACE_S = 10.0
# Past --shutdown-timeout, time for the ingress to write the 503s of its drain.
ANSWER_GRACE_S = 2.0
# Serve's direct-ingress mode keeps a stopping ingress reachable this long so that a load
# balancer can deregister it (30 s by default, plus 5 s Serve adds to the ingress's
# timeout). `flowllm serve` stops the whole application: no replica is left to take
# over, so on a cluster it starts the window is off unless the environment sets one.
DIRECT_INGRESS_DRAIN_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


# Bounds on what a flag may ask for, checked before anything is built for it: a Ray Serve
# application of more replicas than this is beyond what one ingress routes, and a replica
# reserving more CPUs than this is a typo.
MAX_REPLICAS = 1024
MAX_CPUS_PER_REPLICA = 1024.0


class ScaleOutError(ValueError):
    """A flag combination the Ray backend cannot serve; printed as one line."""


def replica_name(index: int) -> str:
    return f"engine-{index}"


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what cannot work, before Ray starts."""
    if not 1 <= args.data_parallel_size <= MAX_REPLICAS:
        raise ScaleOutError(
            f"--data-parallel-size must be between 1 and {MAX_REPLICAS}, "
            f"got {show_number(args.data_parallel_size)}"
        )
    if not 0 < args.cpus_per_replica <= MAX_CPUS_PER_REPLICA:  # false for NaN too
        raise ScaleOutError(
            f"--cpus-per-replica must be > 0 and <= {MAX_CPUS_PER_REPLICA:g}, "
            f"got {show_number(args.cpus_per_replica)}"
        )
    if args.routing_imbalance_bound < 0:
        raise ScaleOutError(
            f"--routing-imbalance-bound must be >= 0, got {args.routing_imbalance_bound}"
        )
    unsupported = [
        flag
        for flag, value in (
            ("--trace-dir", args.trace_dir),
            ("--otlp-traces-endpoint", args.otlp_traces_endpoint),
            ("--ssl-keyfile", args.ssl_keyfile),
            ("--ssl-certfile", args.ssl_certfile),
            ("--api-server-count", args.api_server_count not in (None, 1)),
        )
        if value
    ]
    if unsupported:
        raise ScaleOutError(
            f"{', '.join(unsupported)} not supported with --distributed-executor-backend ray"
        )


def replica_threads(args: argparse.Namespace) -> int:
    """Torch threads of one replica: --cpu-threads, else its Ray CPUs (at least 1)."""
    threads: int = (
        args.cpu_threads if args.cpu_threads is not None else math.floor(args.cpus_per_replica)
    )
    return max(1, threads)


def local_cluster_cpus(args: argparse.Namespace) -> int:
    """Ray CPUs of a cluster started here: the machine's cores, or what the replicas and
    the ingress reserve if that is more (Ray's CPUs are counts, not cores)."""
    needed: float = args.data_parallel_size * args.cpus_per_replica + INGRESS_CPUS
    return max(os.cpu_count() or 1, math.ceil(needed))


def build_application(args: argparse.Namespace) -> Any:
    """The Serve application: the ingress bound to its engine replicas."""
    from ray import serve

    from flowllm.scale_out.ingress import Ingress
    from flowllm.scale_out.replica import EngineReplica

    common: dict[str, Any] = {
        "num_replicas": 1,
        "max_ongoing_requests": MAX_ONGOING_REQUESTS,
        # Past the ingress's drain (stop_application), time to write the last answers.
        "graceful_shutdown_timeout_s": args.shutdown_timeout + ANSWER_GRACE_S,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
        # Serve's line per call would log every probe; --log-requests is flowllm's own.
        "logging_config": {"enable_access_log": False},
    }
    threads = replica_threads(args)
    tokens = [secrets.token_hex(16) for _ in range(args.data_parallel_size)]
    replicas = [
        (
            replica_name(i),
            # Ray annotates `deployment` as the decorator its keyword form returns; called
            # on a class it returns the Deployment.
            serve.deployment(EngineReplica)  # type: ignore[attr-defined]
            .options(
                name=replica_name(i),
                ray_actor_options={"num_cpus": args.cpus_per_replica},
                health_check_period_s=HEALTH_CHECK_PERIOD_S,
                **common,
            )
            .bind(args, threads, tokens[i]),
            tokens[i],
        )
        for i in range(args.data_parallel_size)
    ]
    # Ray annotates `deployment` as the decorator its keyword form returns (see above).
    ingress = serve.deployment(Ingress).options(  # type: ignore[attr-defined]
        name=INGRESS_NAME, ray_actor_options={"num_cpus": INGRESS_CPUS}, **common
    )
    return ingress.bind(args, replicas)


def stop_application(shutdown_timeout: float) -> None:
    """Drain the ingress (flowllm's drain: requests in flight finish for up to
    `shutdown_timeout`, then those still running get a 503 event), then delete the
    application while Serve's HTTP proxy still runs, so that every answer is written
    through it. Serve's own drain alone would cut a stream still running at its deadline
    without a word, and `serve.shutdown` would stop the proxy at once."""
    from ray import serve

    try:
        serve.get_app_handle(APP_NAME).drain.remote().result(
            timeout_s=shutdown_timeout + SHUTDOWN_GRACE_S
        )
    except Exception as e:  # an ingress that failed or never started: Serve's drain still runs
        print(f"warning: the ingress did not drain: {e}", file=sys.stderr)
    serve.delete(APP_NAME, _blocking=False)
    deadline = time.monotonic() + shutdown_timeout + SHUTDOWN_GRACE_S
    while APP_NAME in serve.status().applications and time.monotonic() < deadline:
        time.sleep(SHUTDOWN_POLL_S)


def serve_on_ray(args: argparse.Namespace) -> int:
    """Run the application until SIGINT/SIGTERM; 0 after a clean stop, 1 on a bad flag or
    when the application does not start."""
    from flowllm.engine import graph_for_task
    from flowllm.engine.args import config_from_args
    from flowllm.engine.core import placement_of
    from flowllm.graph.validator import load_graph
    from flowllm.models.draft import check_draft
    from flowllm.models.load_errors import ModelLoadError

    try:
        check_arguments(args)
        args.api_key = resolve_api_key(args.api_key, dict(os.environ))
        cors_config(args)
        auto_tool_parser(args)
        config = config_from_args(args)
        default_template_kwargs(args, config.limits)
        check_draft(config, "--speculative-config")  # before any Ray process starts
        graph = load_graph(
            args.graph
            or graph_for_task(resolve_served_task(args), args.speculative_config is not None)
        )
        if not graph.placement:
            raise ScaleOutError(
                "--distributed-executor-backend ray needs a graph placed in a front and a "
                "core process (stages with process:, as the default graph)"
            )
        placement_of(graph)
        import ray
        from ray import serve
    except ImportError as e:
        print(
            f"error: --distributed-executor-backend ray needs Ray ({e.name} is missing): "
            "pip install 'flowllm[ray]'",
            file=sys.stderr,
        )
        return 1
    except (ScaleOutError, ServeError, ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    warning = exposure_warning(args.host, args.api_key)
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)
    stop = threading.Event()
    serving = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()
        if not serving.is_set():
            raise KeyboardInterrupt  # still starting: unwind, and shut down what started

    def take_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    take_signals()
    status = 0
    started_here = args.ray_address is None
    # Serve runs: the application may be serving (its proxy answers before serve.run
    # returns), so it is stopped with its requests drained.
    serve_started = False
    if started_here:  # read by the Serve processes of the cluster ray.init starts
        os.environ.setdefault(DIRECT_INGRESS_DRAIN_ENV, "0")
    try:
        ray.init(
            # "local": a new cluster, never one some other program started here
            address=args.ray_address if not started_here else "local",
            num_cpus=local_cluster_cpus(args) if started_here else None,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
        take_signals()  # Ray's core installs its own SIGTERM handler, which exits at once
        serve.start(http_options={"host": args.host, "port": args.port})
        serve_started = True
        serve.run(build_application(args), name=APP_NAME, route_prefix="/")
        serving.set()
        print(
            f"flowllm serving {args.data_parallel_size} replicas of {args.model} at "
            f"http://{args.host}:{args.port}/v1 (routing: {args.routing})",
            file=sys.stderr,
            flush=True,
        )
        stop.wait()
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:  # serve.run: a deployment failed to start (its log says why)
        print(f"error: {e}", file=sys.stderr)
        status = 1
    finally:
        serving.set()  # from here a signal no longer interrupts: the shutdown completes
        try:
            if serve_started:
                stop_application(args.shutdown_timeout)
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
    return status
