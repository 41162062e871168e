"""`flowllm serve`'s scale-out flags (vLLM's names where vLLM has the flag)."""

from __future__ import annotations

import argparse

from flowllm.scale_out.router import ROUTING_POLICIES

EXECUTOR_BACKENDS = ("uni", "ray")
DEFAULT_IMBALANCE_BOUND = 8


def add_scale_out_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scale-out on Ray Serve (docs/scale-out.md)")
    group.add_argument(
        "--distributed-executor-backend",
        choices=EXECUTOR_BACKENDS,
        default="uni",
        help="uni: one engine in this process (default); ray: --data-parallel-size engine "
        "replicas behind one ingress on a Ray cluster (pip install 'flowllm[ray]')",
    )
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas, each a whole graph with its own KV cache (needs "
        "--distributed-executor-backend ray above 1)",
    )
    group.add_argument(
        "--ray-address",
        help="join this Ray cluster (e.g. 10.0.0.1:6379, or auto); default: start one on "
        "this machine, stopped when the server exits",
    )
    group.add_argument(
        "--cpus-per-replica",
        type=float,
        default=1.0,
        help="Ray CPUs each engine replica reserves (default 1); --cpu-threads sets its "
        "torch threads (default: this number, at least 1)",
    )
    group.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default="prefix_aware",
        help="prefix_aware (default): to the replica holding the prompt's leading blocks, "
        "the less loaded of two when loads differ too much; round_robin: in turn",
    )
    group.add_argument(
        "--routing-imbalance-bound",
        type=int,
        default=DEFAULT_IMBALANCE_BOUND,
        help="in-flight requests by which replicas may differ before prefix affinity "
        "gives way to the less loaded of two replicas (default %(default)s)",
    )
