"""The end-to-end API tests through the Ray ingress with 2 replicas, and what only a
replicated server has: labelled metrics, routing, aborts reaching the replica, replicas
that are engine cores speaking the cross-process channels' wire."""

from __future__ import annotations

import anyio
import httpx
import ray
from ray import serve
from ray_helpers import REPLICAS, labelled
from server_process import ServerProcess, wait_until
from test_e2e_chat import *  # noqa: F403  (the same tests, on this module's `server`)
from test_e2e_completions import *  # noqa: F403
from test_e2e_errors import *  # noqa: F403
from test_e2e_errors import test_auth_on
from test_e2e_load import test_64_concurrent_streams_complete  # noqa: F401

from flowllm.engine.async_engine import DEFAULT_GRAPH
from flowllm.engine.core_protocol import CONTROL_DECODER, Heartbeat, Hello, Refused
from flowllm.graph.transport import connect, send_all
from flowllm.graph.validator import load_graph
from flowllm.graph.wire import CONTROL, encode_control, read_one_frame, wiring_digest
from flowllm.scale_out.launch import APP_NAME, replica_name

del test_auth_on  # runs in test_ray_auth.py, on a server with a key

# Three blocks' worth of shared text, then a different tail each.
SHARED = "Once upon a time in a land far away there lived a king who had three daughters. " * 2
RUNNING = "flowllm:num_requests_running"
KV_USAGE = "flowllm:kv_cache_usage_perc"
# The ingress fetches each replica's metrics as /metrics is scraped; a counter moves when
# the replica's step that changed it has ended, which may trail the response.
SETTLE_S = 5.0


def _complete(server: ServerProcess, prompt: str, max_tokens: int = 4) -> dict:
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_the_ingress_and_each_replica_reserve_their_cpus(server: ServerProcess) -> None:
    """Two replicas at --cpus-per-replica 1, and the ingress, the front of both, one
    more: Ray places nothing else on the cores they work on."""
    used = ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0.0)
    assert used == 3.0


def test_metrics_label_every_replica_and_count_routing(server: ServerProcess) -> None:
    before = labelled(server, "flowllm:routing_requests_total", "decision")
    for i in range(6):
        _complete(server, f"Metrics request {i}:")
    after = labelled(server, "flowllm:routing_requests_total", "decision")
    assert sum(after.values()) - sum(before.values()) == 6
    assert set(after) == {"prefix_match", "no_match", "imbalanced", "round_robin"}
    assert after["round_robin"] == 0  # this server routes by prefix
    # Every replica's own series, told apart by the label, under both names.
    for name in ("flowllm:request_success_total", "vllm:request_success_total"):
        assert wait_until(
            lambda name=name: set(labelled(server, name, "replica")) == {"0", "1"}, SETTLE_S
        )
    assert labelled(server, "flowllm:replica_up", "replica") == {"0": 1.0, "1": 1.0}
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert (health.status_code, health.text) == (200, "")


def test_shared_prefix_goes_to_the_replica_that_cached_it(server: ServerProcess) -> None:
    first = _complete(server, SHARED + "The first daughter")
    assert first["usage"]["prompt_tokens"] >= 32  # at least two full KV blocks
    assert wait_until(
        lambda: (
            set(labelled(server, "flowllm:prefix_cache_queries_total", "replica")) == {"0", "1"}
        ),
        SETTLE_S,
    )
    hits_before = labelled(server, "flowllm:prefix_cache_hits_total", "replica")
    routed_before = labelled(server, "flowllm:routing_prefix_hit_blocks_total", "decision")
    for tail in ("The second daughter", "The third daughter", "The king"):
        _complete(server, SHARED + tail)
    routed = labelled(server, "flowllm:routing_prefix_hit_blocks_total", "decision")
    assert routed["prefix_match"] - routed_before["prefix_match"] >= 3 * 2

    def hits_grew() -> bool:
        hits = labelled(server, "flowllm:prefix_cache_hits_total", "replica")
        grown = [r for r in hits if hits[r] > hits_before.get(r, 0.0)]
        return len(grown) == 1 and hits[grown[0]] - hits_before.get(grown[0], 0.0) >= 3 * 32

    # All three found the shared blocks cached, on one replica: the one that had them.
    assert wait_until(hits_grew, SETTLE_S)


def _idle(server: ServerProcess) -> bool:
    running = labelled(server, RUNNING, "replica")
    usage = labelled(server, KV_USAGE, "replica")
    return sum(running.values()) == 0 and sum(usage.values()) == 0


def _generated(server: ServerProcess) -> float:
    return sum(labelled(server, "flowllm:generation_tokens_total", "replica").values())


def test_client_disconnect_frees_the_replicas_blocks(server: ServerProcess) -> None:
    """The abort reaches the replica: its sequences stop far short of what was asked and
    its blocks are freed, for a stream cut after its first event and for a non-streamed
    request given up on. Cut at once, not after the replicas' metrics show it running: the
    tiny model could finish the whole job meanwhile."""
    body = {"prompt": "Tell me a long story.", "max_tokens": 480, "ignore_eos": True, "n": 8}
    asked = 8 * 480
    for stream in (True, False):
        assert wait_until(lambda: _idle(server), 10)
        before = _generated(server)
        with httpx.Client(timeout=60) as client:
            if stream:
                with client.stream(
                    "POST", f"{server.url}/v1/completions", json={**body, "stream": True}
                ) as response:
                    assert response.status_code == 200
                    first = next(line for line in response.iter_lines() if line)
                    assert first.startswith("data: {")  # it runs on a replica now
                # Leaving the `with` closes the connection with the stream unfinished.
            else:
                try:
                    client.post(f"{server.url}/v1/completions", json=body, timeout=0.25)
                except httpx.ReadTimeout:
                    pass
                else:
                    raise AssertionError("8 choices of 480 tokens finished within 0.25 s")
        assert wait_until(lambda: _idle(server), SETTLE_S)
        generated = _generated(server) - before
        assert generated < asked / 2, f"{generated} of {asked} tokens generated after the cut"
        if stream:
            assert generated > 0


async def _greet(address: str, hello: Hello) -> object:
    """What a core's port answers a greeting, read as the wire's control frames."""
    sock = await connect(address)
    try:
        await send_all(sock, encode_control(hello))
        with anyio.fail_after(10):
            while True:
                frame = await read_one_frame(sock)
                assert frame.kind == CONTROL
                reply = CONTROL_DECODER.decode(frame.payload)
                if not isinstance(reply, Heartbeat):
                    return reply
    finally:
        sock.close()


def test_replicas_are_engine_cores_on_the_graphs_wire(server: ServerProcess) -> None:
    """Each replica runs the core's stages only (the ingress's fronts run the others) and
    listens on the wire of every cross-process channel: a greeting without the replica's
    token gets the core protocol's refusal."""
    graph = load_graph(DEFAULT_GRAPH)
    front = graph.placement["ingest"]
    core_stages = {s for s, p in graph.placement.items() if p != front}
    hello = Hello(front=0, wiring=wiring_digest(graph.channels), pid=1, token="forged")
    for index in range(REPLICAS):
        handle = serve.get_deployment_handle(replica_name(index), app_name=APP_NAME)
        described = handle.describe.remote().result(timeout_s=30)
        assert set(described["stages"]) == core_stages, described
        reply = anyio.run(_greet, described["address"], hello)
        assert isinstance(reply, Refused) and "token" in reply.reason, reply
    # The replicas' fronts, in the ingress, serve on.
    assert _complete(server, "Still served:")["choices"][0]["finish_reason"] == "length"
