"""One engine replica as the ingress sees it: its handle, whether it serves, its load.

Health comes from two sides: a call that fails because the replica died marks it down at
once, and a probe every `PROBE_INTERVAL_S` marks it up again once Ray has restarted it
(the probe also brings the replica's metrics for /metrics). A replica whose process id
changed is a new process with an empty KV cache.
"""

from __future__ import annotations

from typing import Any

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 5.0  # a replica this slow to answer a probe is treated as down


class ReplicaLink:
    """Replica `index` (Serve deployment `name`) and what the ingress knows of it."""

    def __init__(self, index: int, name: str, handle: Any) -> None:
        self.index = index
        self.name = name
        self.handle = handle  # ray.serve.handle.DeploymentHandle
        # `handle` with stream=True (None without a handle): Ray's handles are untyped.
        self.streaming: Any = handle.options(stream=True) if handle is not None else None
        self.healthy = True
        self.in_flight = 0  # API requests sent and not yet finished
        self.pid: int | None = None
        self.metrics_text = ""  # the replica's registry at the latest probe

    def mark_down(self) -> None:
        self.healthy = False

    def update(self, probe: dict[str, Any]) -> bool:
        """Take a probe's answer; returns whether the replica is a new process."""
        restarted = self.pid is not None and probe["pid"] != self.pid
        self.pid = probe["pid"]
        self.healthy = bool(probe["healthy"])
        self.metrics_text = probe["metrics"].decode()
        return restarted
