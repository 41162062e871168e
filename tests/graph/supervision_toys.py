"""Toy stages for the supervision tests: jobs that fail, hang or restart on purpose."""

from __future__ import annotations

from typing import Any, ClassVar

import anyio
import msgspec

from flowllm.graph.stage import PerMessageStage, RequestInputError, Stage, StageContext
from flowllm.messages import RequestError


class Job(msgspec.Struct, frozen=True):
    request_id: str
    n: int


class JobsParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    count: int
    delay: float = 0.0


class Jobs(Stage):
    """Emits Job r0..r{count-1}, then returns."""

    outputs: ClassVar[dict[str, Any]] = {"out": Job}
    Params = JobsParams

    async def run(self, ctx: StageContext) -> None:
        for n in range(self.params.count):
            await ctx.emit("out", Job(f"r{n}", n))
            if self.params.delay:
                await anyio.sleep(self.params.delay)


class FaultParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    fail_at: tuple[int, ...] = ()
    hang_at: tuple[int, ...] = ()
    refuse_at: tuple[int, ...] = ()  # raise RequestInputError: the client's fault


def _fault(params: FaultParams, n: int) -> None:
    if n in params.fail_at:
        raise RuntimeError(f"boom at {n}")
    if n in params.refuse_at:
        raise RequestInputError(f"job {n} is malformed")


class Flaky(PerMessageStage):
    """Passes jobs on; fails, hangs or refuses the jobs its params name."""

    inputs: ClassVar[dict[str, Any]] = {"in": Job}
    outputs: ClassVar[dict[str, Any]] = {"out": Job, "errors": RequestError}
    Params = FaultParams

    async def handle(self, message: Job, ctx: StageContext) -> None:
        _fault(self.params, message.n)
        if message.n in self.params.hang_at:
            await anyio.sleep_forever()
        await ctx.emit("out", message)


class Tally(Stage):
    """A stage with its own run and state (a count), like schedule: restarts on failure.

    Each instance registers in `services["tallies"]`. Its count is kept in its context
    (`ctx.keep`), so a restarted instance goes on from its predecessor's, which it never
    reads; `inherited` is the count it found there.
    """

    inputs: ClassVar[dict[str, Any]] = {"in": Job}
    outputs: ClassVar[dict[str, Any]] = {"out": Job, "errors": RequestError}
    Params = FaultParams

    def __init__(self, params: Any, services: Any) -> None:
        super().__init__(params, services)
        self.counted = [0]  # one mutable count, what the context keeps
        self.inherited: int | None = None
        services.setdefault("tallies", []).append(self)

    def live_sequences(self) -> int:
        return self.counted[0]

    async def run(self, ctx: StageContext) -> None:
        kept = ctx.keep(self.counted)
        if kept is not self.counted:
            self.inherited, self.counted = kept[0], kept
        while True:
            try:
                message = await ctx.receive("in")
            except anyio.EndOfStream:
                return
            with ctx.handling(message):
                self.counted[0] += 1
                _fault(self.params, message.n)
                if message.n in self.params.hang_at:
                    await anyio.sleep_forever()
                await ctx.emit("out", message)


class Done(PerMessageStage):
    """The sink: what completed and what failed, by request id (in `services`)."""

    inputs: ClassVar[dict[str, Any]] = {"in": Job, "errors": RequestError}

    def __init__(self, params: Any, services: Any) -> None:
        super().__init__(params, services)
        self.completed: list[str] = services.setdefault("completed", [])
        self.failed: dict[str, RequestError] = services.setdefault("failed", {})

    async def handle(self, message: Job | RequestError, ctx: StageContext) -> None:
        if isinstance(message, RequestError):
            self.failed[message.request_id] = message
        else:
            self.completed.append(message.request_id)
