"""Request traces exported by a real server over OTLP/HTTP, decoded from the protobuf."""

from __future__ import annotations

import threading

import httpx
from otlp_receiver import OtlpReceiver, attributes
from server_process import ServerProcess

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER


def test_a_request_is_a_trace_under_the_callers_span(
    observed_server: ServerProcess, otlp_receiver: OtlpReceiver
) -> None:
    response = httpx.post(
        f"{observed_server.url}/v1/completions",
        json={"model": observed_server.model, "prompt": ["Hello there", "Good day"],
              "max_tokens": 4, "n": 2, "temperature": 0.0},
        headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
        timeout=60,
    )  # fmt: skip
    assert response.status_code == 200
    usage = response.json()["usage"]
    trace_id = bytes.fromhex(CALLER_TRACE)

    def complete(spans: list) -> bool:
        return any(s.trace_id == trace_id and s.name == "POST /v1/completions" for s in spans)

    spans = otlp_receiver.wait_for(complete)
    assert "/v1/traces" in otlp_receiver.paths
    assert any(r.get("service.name") == "flowllm" for r in otlp_receiver.resources)
    ours = [s for s in spans if s.trace_id == trace_id]
    (root,) = [s for s in ours if s.name == "POST /v1/completions"]
    assert root.parent_span_id == bytes.fromhex(CALLER_SPAN)
    assert root.kind == SERVER_KIND
    attrs = attributes(root)
    assert attrs["gen_ai.request.model"] == observed_server.model
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == ["length"] * 4
    assert attrs["http.response.status_code"] == 200
    assert attrs["flowllm.request_id"] == response.headers["x-request-id"]
    assert 0 < attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    # The per-request stages are children of the root, each with its queue wait; both
    # prompts pass each of them.
    children = [s for s in ours if s.parent_span_id == root.span_id]
    by_stage: dict[str, int] = {}
    for span in children:
        by_stage[span.name] = by_stage.get(span.name, 0) + 1
        assert attributes(span)["flowllm.queue_wait_s"] >= 0
        assert root.start_time_unix_nano <= span.start_time_unix_nano
        assert span.end_time_unix_nano <= root.end_time_unix_nano
    assert by_stage == {"validate": 2, "tokenize": 2, "schedule": 2}
    # Each per-step stage's spans are traces of their own, linked to the request.
    linked = [
        s for s in spans
        if any(link.trace_id == trace_id and link.span_id == root.span_id for link in s.links)
    ]  # fmt: skip
    assert {s.name for s in linked} >= {
        "step execute", "step sample", "step detokenize", "step deliver", "step schedule"
    }  # fmt: skip
    assert all(s.trace_id != trace_id for s in linked)
    assert all(attributes(s)["flowllm.step_id"] >= 0 for s in linked)


def test_without_traceparent_a_request_starts_its_own_trace(
    observed_server: ServerProcess, otlp_receiver: OtlpReceiver
) -> None:
    response = httpx.post(
        f"{observed_server.url}/v1/chat/completions",
        json={"model": observed_server.model, "max_tokens": 3, "stream": True,
              "messages": [{"role": "user", "content": "Hi"}]},
        timeout=60,
    )  # fmt: skip
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]

    def root_of(spans: list) -> list:
        return [
            s for s in spans
            if s.name == "POST /v1/chat/completions"
            and attributes(s).get("flowllm.request_id") == request_id
        ]  # fmt: skip

    (root,) = root_of(otlp_receiver.wait_for(lambda spans: bool(root_of(spans))))
    assert root.parent_span_id == b""
    attrs = attributes(root)
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["gen_ai.response.id"] == f"chatcmpl-{request_id}"


def test_requests_that_share_steps_are_all_linked_from_them(
    observed_server: ServerProcess, otlp_receiver: OtlpReceiver
) -> None:
    request_ids: list[str] = []

    def one(i: int) -> None:
        response = httpx.post(
            f"{observed_server.url}/v1/completions",
            json={"model": observed_server.model, "prompt": f"prompt {i}", "max_tokens": 24,
                  "ignore_eos": True},
            timeout=60,
        )  # fmt: skip
        assert response.status_code == 200
        request_ids.append(response.headers["x-request-id"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    def roots(spans: list) -> dict[bytes, object]:
        return {
            s.span_id: s for s in spans
            if attributes(s).get("flowllm.request_id") in request_ids
        }  # fmt: skip

    spans = otlp_receiver.wait_for(lambda spans: len(roots(spans)) == 4)
    ours = roots(spans)
    linked: set[bytes] = set()
    widest = 0
    for step in (s for s in spans if s.name == "step execute"):
        ids = {link.span_id for link in step.links} & ours.keys()
        linked |= ids
        widest = max(widest, len(ids))
    assert linked == ours.keys()
    assert widest > 1  # continuous batching ran several of them in one step
