"""A real `flowllm serve` subprocess on 127.0.0.1 for the example-graph tests.

The server runs the tiny random GPT-2 (`--dtype float32 --max-model-len 512
--kv-cache-memory 64MiB`) with a graph file, exactly as a user would start it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
DEFAULT_GRAPH = REPO / "flowllm" / "graph" / "default.yaml"
MODEL_NAME = "tiny"
STARTUP_TIMEOUT = 90.0


class ServerFailed(RuntimeError):
    """The server exited or never became healthy; the message holds its output."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """`python -m flowllm serve MODEL --graph GRAPH` until `stop()`; output goes to a log."""

    def __init__(
        self, model_dir: Path, graph: Path | None, log_dir: Path, cwd: Path | None = None
    ) -> None:
        self.port = free_port()
        self.graph = graph
        self.log_path = log_dir / f"server-{self.port}.log"
        args = [
            sys.executable, "-m", "flowllm", "serve", str(model_dir),
            "--served-model-name", MODEL_NAME,
            "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--log-level", "warning", "--shutdown-timeout", "5",
        ]  # fmt: skip
        if graph is not None:
            args += ["--graph", str(graph)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            args, cwd=cwd or REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(
                    f"server exited with {self.process.returncode}:\n{self.output()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise ServerFailed(f"server not healthy after {timeout} s:\n{self.output()}")

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0, **kwargs
        )

    def stop(self) -> int | None:
        """SIGTERM (a graceful drain), then SIGKILL if it lingers; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._log.close()
        return self.process.returncode


def copy_graph(source: Path, dest: Path, edit: Any = None) -> Path:
    """Copy a graph YAML to `dest`, with relative `.py` paths in `use:` made absolute
    (they are relative to the YAML's folder) and `edit(data)` applied to the parsed YAML."""
    data = yaml.safe_load(source.read_text())
    for stage in data["stages"]:
        module, sep, attr = stage["use"].rpartition(":")
        if module.endswith(".py") and not Path(module).is_absolute():
            stage["use"] = f"{(source.parent / module).resolve()}{sep}{attr}"
    if edit is not None:
        edit(data)
    dest.write_text(yaml.safe_dump(data, sort_keys=False))
    return dest


def stage_entry(data: dict[str, Any], name: str) -> dict[str, Any]:
    """The stage entry named `name` in a parsed graph YAML."""
    for stage in data["stages"]:
        if stage["name"] == name:
            return stage  # type: ignore[no-any-return]
    raise KeyError(name)
