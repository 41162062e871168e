"""One engine replica as the ingress sees it: the front connected to its core.

The ingress runs one front (flowllm/engine/front.py: the per-request stages) per
replica, connected over TCP to that replica's engine core, whose address it asks the
replica for (`locate`), again after each lost connection: a replica Ray restarted
listens on another port, perhaps on another machine. Health is the front's own: its
graph runs, and the core is connected and beat within a second. A core at another
address or with another process id is a new process with an empty KV cache
(`restarted`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import structlog

from flowllm.messages import RequestError

if TYPE_CHECKING:
    from flowllm.engine.front import FrontEngine, Locate

LOCATE_TIMEOUT_S = 5.0  # a replica this slow to say where it listens is asked again
LOCATE_RETRY_S = 0.5


def replica_failed(name: str) -> RequestError:
    """The answer to a request in flight on replica `name` when its core goes away."""
    return RequestError(
        request_id="",
        message=f"The engine replica serving this request ({name}) failed; retry.",
        kind="unavailable",
        code="replica_failed",
    )


def locate(name: str, handle: Any) -> Locate:
    """Where replica `name`'s core listens, asked of its Serve deployment `handle` (a
    `DeploymentHandle`) until it answers: while Ray restarts the replica, calls fail or
    wait."""
    log = structlog.get_logger("flowllm.scale_out").bind(replica=name)

    async def address() -> str:
        while True:
            try:
                with anyio.fail_after(LOCATE_TIMEOUT_S):
                    described: dict[str, Any] = await handle.describe.remote()
                return str(described["address"])
            except Exception as exc:  # Ray's errors of a dead or restarting actor
                log.info("replica not reachable yet", error=repr(exc))
                await anyio.sleep(LOCATE_RETRY_S)

    return address


class ReplicaLink:
    """Replica `index` (Serve deployment `name`), reached through `front`."""

    def __init__(self, index: int, name: str, front: FrontEngine) -> None:
        self.index = index
        self.name = name
        self.front = front
        self._core = self._identity()

    @property
    def healthy(self) -> bool:
        return self.front.healthy

    @property
    def in_flight(self) -> int:
        """Requests (one per prompt) sent to the replica and not yet finished."""
        return len(self.front.services.mailboxes)

    def restarted(self) -> bool:
        """Whether the core is another process than at the last call."""
        identity = self._identity()
        if identity == self._core:
            return False
        self._core = identity
        return True

    def _identity(self) -> tuple[str, int | None]:
        link = self.front.link
        return link.core_address, link.ready.pid if link.ready is not None else None
