"""Toy stages and messages for the graph runtime tests: no model, just numbers."""

from __future__ import annotations

from typing import Any, ClassVar

import anyio
import msgspec

from flowllm.graph.stage import CLOSED, PerMessageStage, SourceStage, Stage, StageContext


class Item(msgspec.Struct, frozen=True):
    """A numbered message; `origin` says which producer made it."""

    seq: int
    origin: str = ""


class Other(msgspec.Struct, frozen=True):
    """A second message kind, for type checks."""

    text: str


class Step(msgspec.Struct, frozen=True):
    """A per-step message, so spans carry step_id and batch_size."""

    step_id: int
    seqs: tuple[int, ...]


class CountParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    count: int
    origin: str = ""


class Count(Stage):
    """Emits Item(0..count-1) and returns: a finite source."""

    outputs: ClassVar[dict[str, Any]] = {"out": Item}
    Params = CountParams

    async def run(self, ctx: StageContext) -> None:
        origin = self.params.origin or ctx.name
        for seq in range(self.params.count):
            await ctx.emit("out", Item(seq, origin))


class DelayParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    delay: float = 0.0


class Relay(PerMessageStage):
    """Passes every Item on, optionally after a delay."""

    inputs: ClassVar[dict[str, Any]] = {"in": Item}
    outputs: ClassVar[dict[str, Any]] = {"out": Item}
    Params = DelayParams

    def __init__(self, params: Any, services: Any) -> None:
        super().__init__(params, services)
        self.handled = 0

    async def handle(self, message: Item, ctx: StageContext) -> None:
        self.handled += 1
        if self.params.delay:
            await anyio.sleep(self.params.delay)
        await ctx.emit("out", message)


class Collect(PerMessageStage):
    """A sink keeping what it received; slow when `delay` > 0."""

    inputs: ClassVar[dict[str, Any]] = {"in": Item}
    Params = DelayParams

    def __init__(self, params: Any, services: Any) -> None:
        super().__init__(params, services)
        self.items: list[Item] = []
        self.failed_with: BaseException | None = None
        if isinstance(services, dict):
            services.setdefault("collectors", []).append(self)

    async def handle(self, message: Item, ctx: StageContext) -> None:
        if self.params.delay:
            await anyio.sleep(self.params.delay)
        self.items.append(message)

    async def fail_inflight(self, error: BaseException) -> None:
        self.failed_with = error


class FailParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    fail_at: int


class Explode(PerMessageStage):
    """Raises on the message whose seq is `fail_at`."""

    inputs: ClassVar[dict[str, Any]] = {"in": Item}
    outputs: ClassVar[dict[str, Any]] = {"out": Item}
    Params = FailParams

    async def handle(self, message: Item, ctx: StageContext) -> None:
        if message.seq == self.params.fail_at:
            raise RuntimeError(f"boom at {message.seq}")
        await ctx.emit("out", message)


class Feeder(SourceStage):
    """A source fed by the graph's owner through `submit`, like `ingest`."""

    outputs: ClassVar[dict[str, Any]] = {"out": Item}

    def __init__(self, params: Any, services: Any) -> None:
        super().__init__(params, services)
        self.accepting = True

    async def submit(self, item: Item) -> None:
        if not self.accepting:
            raise RuntimeError("not accepting")
        await self.context.emit("out", item)

    async def stop_intake(self) -> None:
        self.accepting = False


class Pending(PerMessageStage):
    """Holds every message as in-flight work until the graph fails (a stand-in for deliver)."""

    inputs: ClassVar[dict[str, Any]] = {"in": Item}

    def __init__(self, params: Any, services: Any) -> None:
        super().__init__(params, services)
        self.open: set[int] = set()
        self.failed: dict[int, str] = {}
        if isinstance(services, dict):
            services["pending"] = self

    async def handle(self, message: Item, ctx: StageContext) -> None:
        self.open.add(message.seq)

    async def fail_inflight(self, error: BaseException) -> None:
        for seq in sorted(self.open):
            self.failed[seq] = f"500: {error}"
        self.open.clear()


class Merge(Stage):
    """Two inputs, `urgent` first; records the order in which it took messages."""

    inputs: ClassVar[dict[str, Any]] = {"urgent": Item, "normal": Item}
    outputs: ClassVar[dict[str, Any]] = {"out": Item}

    def __init__(self, params: Any, services: Any) -> None:
        super().__init__(params, services)
        self.closed_ports: list[str] = []

    async def run(self, ctx: StageContext) -> None:
        while True:
            try:
                port, message = await ctx.receive_any("urgent", "normal")
            except anyio.EndOfStream:
                return
            if message is CLOSED:
                self.closed_ports.append(port)
                continue
            with ctx.handling(message):
                await ctx.emit("out", message)


class Sink(PerMessageStage):
    """Accepts anything (`Any`-typed input)."""

    inputs: ClassVar[dict[str, Any]] = {"in": Any}

    async def handle(self, message: Any, ctx: StageContext) -> None:
        return None


class Texts(Stage):
    """Emits Other messages (for type-mismatch fixtures)."""

    outputs: ClassVar[dict[str, Any]] = {"out": Other}

    async def run(self, ctx: StageContext) -> None:
        return None


class MixedOut(Stage):
    """Emits Item or Other on one port."""

    outputs: ClassVar[dict[str, Any]] = {"out": Item | Other}

    async def run(self, ctx: StageContext) -> None:
        return None


class LoopParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_inflight_steps: int = 1
    steps: int = 10


class Loop(Stage):
    """A credit-bounded loop head, shaped like `schedule`.

    Takes requests (`requests`) and results (`results`, priority); keeps at most
    `max_inflight_steps` Steps in flight around the cycle; ends once its request input is
    closed and nothing is in flight.
    """

    inputs: ClassVar[dict[str, Any]] = {"requests": Item, "results": Step}
    outputs: ClassVar[dict[str, Any]] = {"steps": Step, "done": Item}
    Params = LoopParams
    credit_param = "max_inflight_steps"

    def __init__(self, params: Any, services: Any) -> None:
        super().__init__(params, services)
        self.max_inflight_seen = 0

    async def run(self, ctx: StageContext) -> None:
        waiting: list[Item] = []
        inflight = 0
        step_id = 0
        remaining: dict[int, int] = {}
        requests_open = True
        while True:
            while waiting and inflight < self.params.max_inflight_steps:
                item = waiting.pop(0)
                remaining[item.seq] = self.params.steps
                await ctx.emit("steps", Step(step_id, (item.seq,)))
                step_id += 1
                inflight += 1
                self.max_inflight_seen = max(self.max_inflight_seen, inflight)
            if not requests_open and inflight == 0 and not waiting:
                return
            port, message = await ctx.receive_any("results", "requests")
            if message is CLOSED:
                if port == "requests":
                    requests_open = False
                continue
            if port == "requests":
                waiting.append(message)
                continue
            inflight -= 1
            (seq,) = message.seqs
            remaining[seq] -= 1
            if remaining[seq] == 0:
                await ctx.emit("done", Item(seq, "loop"))
            else:
                await ctx.emit("steps", Step(step_id, (seq,)))
                step_id += 1
                inflight += 1
                self.max_inflight_seen = max(self.max_inflight_seen, inflight)


class PacedLoop(Loop):
    """`Loop`'s declaration with a note per step beside the loop and finishes coming back,
    shaped like `schedule` (validation fixtures only: it is never run)."""

    inputs: ClassVar[dict[str, Any]] = {**Loop.inputs, "finishes": Item}
    outputs: ClassVar[dict[str, Any]] = {**Loop.outputs, "notes": Step}
    optional_inputs = frozenset({"finishes"})
    per_step_outputs = frozenset({"notes"})


class StrayPerStep(Stage):
    """Declares a per-step port it does not have."""

    outputs: ClassVar[dict[str, Any]] = {"notes": Step}
    Params = LoopParams
    credit_param = "max_inflight_steps"
    per_step_outputs = frozenset({"notse"})


class UncreditedPerStep(Stage):
    """Declares a per-step port but no credit bound to count its steps by."""

    outputs: ClassVar[dict[str, Any]] = {"notes": Step}
    per_step_outputs = frozenset({"notes"})


class NoteTaker(PerMessageStage):
    """Takes a loop's notes and its steps, sends finishes back: `detokenize`'s shape
    (validation fixtures only: it is never run)."""

    inputs: ClassVar[dict[str, Any]] = {"notes": Step, "in": Step}
    outputs: ClassVar[dict[str, Any]] = {"finishes": Item}


class StepRelay(PerMessageStage):
    """Passes a Step on (a stand-in for execute / sample)."""

    inputs: ClassVar[dict[str, Any]] = {"in": Step}
    outputs: ClassVar[dict[str, Any]] = {"out": Step}

    async def handle(self, message: Step, ctx: StageContext) -> None:
        await ctx.emit("out", message)


class NotAStage:
    """A plain class, for the 'not a Stage' fixture."""


class Take(Stage):
    """Passes the first `count` Items on, then returns with its input still open."""

    inputs: ClassVar[dict[str, Any]] = {"in": Item}
    outputs: ClassVar[dict[str, Any]] = {"out": Item}
    Params = CountParams

    async def run(self, ctx: StageContext) -> None:
        for _ in range(self.params.count):
            await ctx.emit("out", await ctx.receive("in"))
