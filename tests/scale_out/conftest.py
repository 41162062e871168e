"""`flowllm serve --distributed-executor-backend ray` with 2 replicas of the tiny GPT-2.

Each server is the real command in a subprocess. Most join one Ray cluster that this
session starts once (`--ray-address`; 2 logical CPUs, one per replica) and shut their Serve
application down when they get SIGTERM; the fault test's server starts a cluster of its
own, as `flowllm serve` does without `--ray-address`, and must leave no process behind.
Servers are module-scoped, so one runs at a time. The end-to-end API tests (tests/e2e)
run against them unchanged: the fixtures here have the names theirs have.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # e2e_helpers, e2e tests

import ray  # flowllm[ray]: `make test` installs it, and these tests are never skipped
from e2e_helpers import API_KEY, CHAT_TEMPLATE, FLOOD_MAX_PENDING, start_server
from ray_helpers import REPLICAS, STOP_BOUND_S, stop_within
from server_process import TINY_FLAGS, ServerProcess, small_pending_graph

RAY_FLAGS = (
    "--distributed-executor-backend", "ray", "--data-parallel-size", str(REPLICAS),
    "--cpus-per-replica", "1", "--cpu-threads", "1",
)  # fmt: skip


CLUSTER_CPUS = 3  # logical CPUs: one per replica, one for the ingress
# Ray kills workers when the machine's memory is 95 % used, which a machine shared with
# other test runs reaches without any danger to these small replicas: the kernel decides.
NO_RAY_OOM_KILLER = {"RAY_memory_monitor_refresh_ms": "0"}


def start_ray_server(model: Path, flags: tuple[str, ...] = (), **kwargs: object) -> ServerProcess:
    return start_server(str(model), [*TINY_FLAGS, *RAY_FLAGS, *flags], **kwargs)  # type: ignore[arg-type]


def pytest_configure(config: pytest.Config) -> None:
    # Serve awaits a replica's `async def __del__` as it stops it (the tests that build
    # replicas in this process do too); the collector calls it again, unawaited, later.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:coroutine 'EngineReplica.__del__' was never awaited:RuntimeWarning",
    )


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """The address of a Ray cluster on this machine, for the session; shut down after."""
    saved = {name: os.environ.get(name) for name in NO_RAY_OOM_KILLER}
    os.environ.update(NO_RAY_OOM_KILLER)  # read by the raylet ray.init starts
    try:
        ray.init(address="local", num_cpus=CLUSTER_CPUS, include_dashboard=False)
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def stop_leaving_nothing(proc: ServerProcess) -> None:
    """SIGTERM the server: it exits 0, and every process it started (Ray's) is gone."""
    code, took = stop_within(proc, STOP_BOUND_S)
    assert code == 0, f"flowllm serve exited with {code} after {took:.1f} s"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def chat_template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ray-template") / "chatml.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(
    gpt2_tiny_dir: Path, chat_template_file: Path, ray_address: str
) -> Iterator[ServerProcess]:
    """Two replicas behind the ingress, no API key, a ChatML template for chat."""
    proc = start_ray_server(
        gpt2_tiny_dir,
        ("--chat-template", str(chat_template_file), "--ray-address", ray_address),
    )
    try:
        yield proc
    finally:
        stop_leaving_nothing(proc)


@pytest.fixture(scope="module")
def auth_server(gpt2_tiny_dir: Path, ray_address: str) -> Iterator[ServerProcess]:
    """Two replicas behind `--api-key`."""
    proc = start_ray_server(gpt2_tiny_dir, ("--api-key", API_KEY, "--ray-address", ray_address))
    try:
        yield proc
    finally:
        stop_leaving_nothing(proc)


@pytest.fixture(scope="module")
def flood_server(
    gpt2_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory, ray_address: str
) -> Iterator[ServerProcess]:
    """Two replicas whose ingest admits `FLOOD_MAX_PENDING` requests without output, and
    at most 2 sequences a step."""
    graph = small_pending_graph(
        tmp_path_factory.mktemp("ray-graph") / "small-pending.yaml", FLOOD_MAX_PENDING
    )
    proc = start_ray_server(
        gpt2_tiny_dir, ("--max-num-seqs", "2", "--ray-address", ray_address), graph=graph
    )
    try:
        yield proc
    finally:
        stop_leaving_nothing(proc)


@pytest.fixture
def start_own_cluster_server(gpt2_tiny_dir: Path) -> Callable[..., ServerProcess]:
    """Starts a server on a Ray cluster of its own, with `env` added to its environment
    and `flags` to its command line; the test stops it."""

    def start(env: dict[str, str], flags: tuple[str, ...] = ()) -> ServerProcess:
        return start_ray_server(gpt2_tiny_dir, flags, env={**NO_RAY_OOM_KILLER, **env})

    return start


@pytest.fixture
def start_shared_cluster_server(
    gpt2_tiny_dir: Path, ray_address: str
) -> Callable[..., ServerProcess]:
    """Starts a server on the session's Ray cluster, with `flags` added to its command
    line; the test stops it."""

    def start(flags: tuple[str, ...] = ()) -> ServerProcess:
        return start_ray_server(gpt2_tiny_dir, ("--ray-address", ray_address, *flags))

    return start


@pytest.fixture(scope="module")
def own_cluster_server(gpt2_tiny_dir: Path) -> Iterator[ServerProcess]:
    """Two replicas on a Ray cluster the server starts itself (no `--ray-address`)."""
    proc = start_ray_server(gpt2_tiny_dir, env=NO_RAY_OOM_KILLER)
    try:
        yield proc
    finally:
        stop_leaving_nothing(proc)
