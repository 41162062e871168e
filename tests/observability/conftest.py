"""One real `flowllm serve` of the tiny GPT-2 with every observability feature on: traces
exported over OTLP/HTTP to a test receiver, JSON logs at INFO with request logging. The
trace, log and Prometheus tests all read it (starting a server costs seconds)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/observability

from otlp_receiver import OtlpReceiver
from server_process import TINY_FLAGS, ServerProcess


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    try:
        yield receiver
    finally:
        receiver.close()


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="session")
def observed_server(
    gpt2_tiny_dir: Path, otlp_receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("observability") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    server = ServerProcess(
        str(gpt2_tiny_dir),
        [
            *TINY_FLAGS,
            "--chat-template", str(template),
            "--otlp-traces-endpoint", otlp_receiver.url,  # no path: /v1/traces is added
            "--log-format", "json",
            "--log-level", "info",
            "--enable-log-requests",
        ],
        served_model_name="gpt2-tiny",  # a plain name: the dashboard matches it as a regex
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},  # export every 0.1 s, not every 5 s
    )  # fmt: skip
    try:
        yield server.wait_healthy()
    finally:
        server.stop()
