"""A real `python -m flowllm serve` subprocess on 127.0.0.1, for the tests that need one.

The server is started exactly as a user would start it, on a free port; `wait_healthy()`
waits for `/health` and fails with the server's own output, `stop()` sends SIGTERM (a
graceful drain) and SIGKILL if it lingers. Shared by tests/e2e and tests/examples.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai

from flowllm.config import BUNDLED_MODEL

REPO = Path(__file__).resolve().parents[1]
DEFAULT_GRAPH = REPO / "flowllm" / "engine" / "default.yaml"
# The server flags every tiny-model server shares.
TINY_FLAGS = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB")
STARTUP_TIMEOUT = 120.0  # seconds; the machines are shared, loading may be slow
CLIENT_TIMEOUT = 60.0  # seconds, for the clients that bring no http_client of their own


class ServerFailed(RuntimeError):
    """`flowllm serve` exited or never answered /health; the message holds its output."""


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants: a server is its supervisor, its engine core and its
    fronts."""
    pids, queue = [], [pid]
    while queue:
        current = queue.pop()
        pids.append(current)
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        queue.extend(int(child) for child in children)
    return pids


def free_port() -> int:
    """A port nothing listens on now, below the kernel's ephemeral range: a port the kernel
    picked (bind to port 0) can be taken by any process's next outgoing connection before
    the server binds it, and a Ray cluster makes many."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(1000):
        port = random.randrange(10000, max(10001, low))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


class ServerProcess:
    """One `python -m flowllm serve` subprocess until `stop()`; its output goes to a log file."""

    def __init__(
        self,
        model: str | Path | None,
        flags: Sequence[str] = (),
        *,
        graph: Path | None = None,
        served_model_name: str | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        log_dir: Path | None = None,
        tls: ssl.SSLContext | None = None,
        python: Path | None = None,
    ) -> None:
        """`model` None: no model argument, so the server's default (the bundled model).

        `python`: the interpreter of another environment, which serves its installed flowllm
        (not this checkout) in exactly the environment `env`.

        `tls`: the server runs HTTPS (its --ssl-* flags are in `flags`); this client
        context, which trusts its CA (and holds a client certificate if it asks for one),
        is what `wait_healthy()` connects with.

        `log_dir` None: the log is a temporary file, deleted by `stop()`; otherwise it is
        `log_dir/server-PORT.log` and is kept.
        """
        self.port = free_port()
        self.tls = tls
        self.url = f"{'https' if tls is not None else 'http'}://127.0.0.1:{self.port}"
        self.graph = graph
        # The name the server lists and answers to: by default the model argument as given.
        default_name = str(model) if model is not None else BUNDLED_MODEL
        self.model = served_model_name if served_model_name is not None else default_name
        # Output goes to a file, not a pipe: a chatty server must never block on a full pipe.
        self._delete_log = log_dir is None
        if log_dir is None:
            fd, name = tempfile.mkstemp(prefix="flowllm-serve-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        else:
            self.log_path = log_dir / f"server-{self.port}.log"
        args = [
            str(python or sys.executable), "-m", "flowllm", "serve",
            *([str(model)] if model is not None else []),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--log-level", "warning", "--shutdown-timeout", "5", *flags,
        ]  # fmt: skip
        if served_model_name is not None:
            args += ["--served-model-name", served_model_name]
        if graph is not None:
            args += ["--graph", str(graph)]
        if python is not None:
            full_env = {"PYTHONUNBUFFERED": "1", **(env or {})}
        else:
            full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
            # The repository first on the path, so the server imports this checkout from
            # any cwd.
            full_env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(REPO), full_env.get("PYTHONPATH")])
            )
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            args, cwd=cwd or REPO, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def processes_named(self, prefix: str) -> list[int]:
        """The server's processes whose name starts with `prefix` (flowllm-core,
        flowllm-front)."""
        found = []
        for pid in process_tree(self.process.pid):
            try:
                if Path(f"/proc/{pid}/comm").read_text().startswith(prefix):
                    found.append(pid)
            except OSError:
                continue
        return found

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(
                    f"flowllm serve exited with {self.process.returncode}:\n{self.output()}"
                )
            try:
                verify = self.tls if self.tls is not None else True
                health = httpx.get(f"{self.url}/health", timeout=2.0, verify=verify)
                if health.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise ServerFailed(f"flowllm serve not healthy after {timeout} s:\n{self.output()}")

    def _client_args(self, api_key: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        args: dict[str, Any] = {"base_url": f"{self.url}/v1", "api_key": api_key, "max_retries": 0}
        if "http_client" not in kwargs:  # an http_client brings its own timeout
            args["timeout"] = CLIENT_TIMEOUT
        return {**args, **kwargs}

    def client(self, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(**self._client_args(api_key, kwargs))

    def async_client(self, api_key: str = "unused", **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(**self._client_args(api_key, kwargs))

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, by name (`flowllm:kv_cache_usage_perc`...);
        a replicated server's (tests/scale_out) summed over its `replica` label."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            match = re.fullmatch(r'([A-Za-z_:][A-Za-z0-9_:]*)(\{replica="\d+"\})? (\S+)', line)
            if match:
                name = match.group(1)
                values[name] = values.get(name, 0.0) + float(match.group(3))
        return values

    def stop(self, sig: signal.Signals = signal.SIGTERM, wait: float = 15.0) -> int | None:
        """`sig` (SIGTERM or SIGINT: a graceful drain), then SIGKILL if it lingers past
        `wait` seconds; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._log.close()
        if self._delete_log:
            self.log_path.unlink(missing_ok=True)
        return self.process.returncode


def small_pending_graph(dest: Path, max_pending: int) -> Path:
    """Write to `dest` a copy of the default graph whose ingest admits only `max_pending`
    requests without output (the rest get 503 + Retry-After); returns `dest`."""
    text = DEFAULT_GRAPH.read_text()
    limited = text.replace("{max_pending: 1024}", f"{{max_pending: {max_pending}}}")
    if limited == text:
        raise RuntimeError("default.yaml no longer sets ingest's max_pending: update the tests")
    dest.write_text(limited)
    return dest


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll `condition` every 20 ms until it holds or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
