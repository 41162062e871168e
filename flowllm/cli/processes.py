"""`flowllm serve` of a graph placed across processes: one core, N fronts, supervised.

This process binds the listening socket, converts the model if needed, then starts the
engine core (flowllm/engine/core.py) and `--api-server-count` front processes, which
share the socket and connect to the core over a Unix socket. It runs no stage itself:

- **The core exits** (died, or escalated): the fronts answer what was in flight with a
  503 at once and `/health` with 503; the core is started again under the step loop's
  restart intensity (its `supervision:` settings in the graph). Past it, the server
  escalates: the fronts stop and this process exits with `EXIT_ENGINE_FAILED`.
- **A front exits**: the others keep serving; the core aborts the dead front's requests,
  and a new front takes its place, under the same intensity.
- **SIGTERM or SIGINT**: the fronts drain their requests (`--shutdown-timeout`), then the
  core stops; a second signal passes on to the fronts, which then answer and go.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from flowllm.config import EngineConfig
from flowllm.engine.core import EXIT_INVALID_GRAPH, CoreSpec, placement_of, start_core
from flowllm.graph.problems import GraphValidationError
from flowllm.graph.spec import GraphSpec
from flowllm.graph.supervision import RestartIntensity, parse_supervision
from flowllm.graph.validator import ValidGraph, validate_graph

EXIT_ENGINE_FAILED = 70  # as a single-process server's escalation (flowllm/server.py)
FRONT_STOP_GRACE_S = 5.0  # past the shutdown timeout, before a front is killed

# A front's server: (args, listener, front index, core address) -> exit status.
ServeFront = Callable[[argparse.Namespace, socket.socket, int, str], int]


@dataclass(frozen=True)
class FrontSpec:
    """What a front process is started with; `serve` is a module-level function, so that
    the spawned process imports it by name."""

    args: argparse.Namespace
    listener: socket.socket
    index: int
    core_address: str
    serve: ServeFront


def step_loop_intensity(graph: GraphSpec, core: str) -> RestartIntensity:
    """The restart intensity of the core's restartable group (the step loop): read from
    the graph's file while its core stages name their `on_error` (the default graph's
    do), else from the validated graph, which imports the stages (and torch) to learn
    their classes' defaults."""
    for stage in graph.stages:
        if graph.placement.get(stage.name) != core:
            continue
        try:
            settings = parse_supervision(stage.supervision)
        except ValueError:  # the validation says what is wrong
            return _validated_intensity(validate_graph(graph), core)
        if settings.on_error is None:
            return _validated_intensity(validate_graph(graph), core)
        if settings.on_error == "restart":
            return RestartIntensity(settings.max_restarts, settings.within_s)
    return RestartIntensity(5, 60.0)


def _validated_intensity(graph: ValidGraph, core: str) -> RestartIntensity:
    for bound in graph.stages.values():
        if graph.placement[bound.name] == core and bound.supervision.on_error == "restart":
            settings = bound.supervision.settings
            return RestartIntensity(settings.max_restarts, settings.within_s)
    return RestartIntensity(5, 60.0)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Supervisor:
    """Starts, watches and restarts the core and the fronts of one `flowllm serve`.

    `serve_front` is each front's HTTP server, given by the command that owns it
    (flowllm/cli/serve.py): the supervisor starts processes and knows nothing of HTTP."""

    def __init__(
        self,
        args: argparse.Namespace,
        config: EngineConfig,
        graph: GraphSpec,
        threads: int | None,
        serve_front: ServeFront,
    ) -> None:
        self.args = args
        self.serve_front = serve_front
        self.log = structlog.get_logger("flowllm.serve")
        self.context = multiprocessing.get_context("spawn")
        self.folder = tempfile.mkdtemp(prefix="flowllm-")
        self.graph = graph
        self.intensity = step_loop_intensity(graph, placement_of(graph)[1])
        self.front_intensity = RestartIntensity(
            self.intensity.max_restarts, self.intensity.within_s
        )
        self.core_spec = CoreSpec(
            config=config,
            graph_file=graph.source,
            address=os.path.join(self.folder, "core.sock"),
            fronts=args.api_server_count,
            threads=threads,
            log_format=args.log_format,
            log_level=args.log_level,
            stop_timeout=args.shutdown_timeout,
        )
        self.listener = bind(args.host, args.port)
        self.core: Any = None
        self.fronts: list[Any] = []
        self.signals = 0

    def _graph_is_invalid(self, exitcode: int | None) -> bool:
        """Whether a process exited because the graph's stages do not validate
        (EXIT_INVALID_GRAPH: each process validates them as it loads): if so, the graph is
        validated here, and its problems printed once, as `serve` prints a flag's error."""
        if exitcode != EXIT_INVALID_GRAPH:
            return False
        try:
            validate_graph(self.graph)
        except GraphValidationError as e:
            print(f"error: {e}", file=sys.stderr)
            return True
        return False

    def _start_core(self) -> None:
        self.core = start_core(self.core_spec)
        self.log.info("engine core started", pid=self.core.pid)

    def _start_front(self, index: int) -> Any:
        spec = FrontSpec(self.args, self.listener, index, self.core_spec.address, self.serve_front)
        process = self.context.Process(
            target=run_front, args=(spec,), name=f"flowllm-front-{index}"
        )
        process.start()
        return process

    def _on_signal(self, _sig: int, _frame: object) -> None:
        self.signals += 1
        for front in self.fronts:
            if front.is_alive():
                os.kill(front.pid, signal.SIGTERM)

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            # The fronts first: they take longer to be ready than the core (HTTP, tokenizer).
            self.fronts = [self._start_front(i) for i in range(self.args.api_server_count)]
            self._start_core()
            return self._watch()
        finally:
            self._stop_all()
            self.listener.close()
            shutil.rmtree(self.folder, ignore_errors=True)

    def _watch(self) -> int:
        while True:
            if self.signals:
                return self._drain()
            sentinels = [self.core.sentinel, *(f.sentinel for f in self.fronts)]
            multiprocessing.connection.wait(sentinels, timeout=0.2)
            if not self.core.is_alive() and not self.signals:
                code = self.core.exitcode
                if self._graph_is_invalid(code):
                    return 1
                if not self.intensity.admit():
                    self.log.error(
                        "the engine core failed past its restart intensity; exiting",
                        exitcode=code,
                        max_restarts=self.intensity.max_restarts,
                        within_s=self.intensity.within_s,
                    )
                    return EXIT_ENGINE_FAILED
                self.log.error("the engine core exited; starting it again", exitcode=code)
                self._start_core()
            for index, front in enumerate(self.fronts):
                if not front.is_alive() and not self.signals:
                    code = front.exitcode
                    if self._graph_is_invalid(code):
                        return 1
                    if code == EXIT_ENGINE_FAILED or not self.front_intensity.admit():
                        self.log.error("a front failed for good; exiting", front=index)
                        return EXIT_ENGINE_FAILED
                    self.log.error("a front exited; starting it again", front=index, exitcode=code)
                    self.fronts[index] = self._start_front(index)

    def _drain(self) -> int:
        """Fronts first (they finish their requests), then the core."""
        deadline = self.args.shutdown_timeout + FRONT_STOP_GRACE_S
        for front in self.fronts:
            front.join(deadline)
        failed = any(f.exitcode not in (0, None) for f in self.fronts)
        if self.core.is_alive():
            os.kill(self.core.pid, signal.SIGTERM)
            self.core.join(deadline)
        return EXIT_ENGINE_FAILED if failed else 0

    def _stop_all(self) -> None:
        for process in [*self.fronts, self.core]:
            if process is not None and process.is_alive():
                process.terminate()
                process.join(FRONT_STOP_GRACE_S)
                if process.is_alive():
                    process.kill()


def run_front(spec: FrontSpec) -> None:
    """A front process's entry point: the HTTP server over the front's part of the graph."""
    from flowllm.engine.core import become_child

    become_child(f"flowllm-front{spec.index}")
    raise SystemExit(spec.serve(spec.args, spec.listener, spec.index, spec.core_address))
