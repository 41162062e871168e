"""The default graph's stages with a fault injected at their k-th message, for the fault
injection tests: each class here is the real stage, failing as `FAULTS[name]` says.

The test sets `FAULTS` before building a graph whose `use:` points here
(`fault_graph`); the stage then raises, hangs or slows down at its `at`-th message (and,
with `every`, at every message after it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from flowllm.stages.deliver import Deliver
from flowllm.stages.detokenize import Detokenize
from flowllm.stages.execute import Execute
from flowllm.stages.guide import Guide
from flowllm.stages.ingest import Ingest
from flowllm.stages.propose import Propose
from flowllm.stages.sample import Sample
from flowllm.stages.schedule import Schedule
from flowllm.stages.tokenize import Tokenize
from flowllm.stages.validate import Validate

DEFAULT_GRAPH = Path(__file__).resolve().parents[2] / "flowllm" / "engine" / "default.yaml"


@dataclass
class Fault:
    at: int = 1  # the message (1-based) the fault hits
    kind: str = "raise"  # raise | hang | slow
    every: bool = False  # also every message after `at`
    slow_s: float = 0.3
    seen: int = 0  # messages counted so far (shared by restarted instances)
    hits: int = 0


FAULTS: dict[str, Fault] = {}


class InjectedFault(RuntimeError):
    """The fault a test asked for."""


async def strike(name: str) -> None:
    """Count one message of stage `name`; fail, hang or sleep if the fault hits it."""
    fault = FAULTS.get(name)
    if fault is None:
        return
    fault.seen += 1
    if fault.seen != fault.at and not (fault.every and fault.seen > fault.at):
        return
    fault.hits += 1
    if fault.kind == "raise":
        raise InjectedFault(f"injected into {name} at message {fault.seen}")
    if fault.kind == "hang":
        await anyio.sleep_forever()
    await anyio.sleep(fault.slow_s)


def strike_now(name: str) -> None:
    """`strike` for a synchronous method (ingest's submit): only raising is possible."""
    fault = FAULTS.get(name)
    if fault is None:
        return
    fault.seen += 1
    if fault.seen == fault.at or (fault.every and fault.seen > fault.at):
        fault.hits += 1
        raise InjectedFault(f"injected into {name} at message {fault.seen}")


class FaultyIngest(Ingest):
    def submit_all(self, requests: Any) -> Any:
        strike_now("ingest")
        return super().submit_all(requests)


class FaultyValidate(Validate):
    async def handle(self, message: Any, ctx: Any) -> None:
        await strike("validate")
        await super().handle(message, ctx)


class FaultyTokenize(Tokenize):
    async def handle(self, message: Any, ctx: Any) -> None:
        await strike("tokenize")
        await super().handle(message, ctx)


class FaultySchedule(Schedule):
    async def _add(self, request: Any, ctx: Any) -> None:
        await strike("schedule")
        await super()._add(request, ctx)


class FaultyExecute(Execute):
    async def execute_step(self, message: Any, sampled: Any, ctx: Any) -> None:
        await strike("execute")
        await super().execute_step(message, sampled, ctx)


class FaultySample(Sample):
    async def sample_step(self, message: Any, masks: Any, ctx: Any) -> None:
        await strike("sample")
        await super().sample_step(message, masks, ctx)


class FaultyGuide(Guide):
    async def handle(self, message: Any, ctx: Any) -> None:
        await strike("guide")
        await super().handle(message, ctx)


class FaultyPropose(Propose):
    async def _propose(self, batch: Any, step: Any) -> Any:
        await strike("propose")
        return await super()._propose(batch, step)


class FaultyDetokenize(Detokenize):
    async def handle(self, message: Any, ctx: Any) -> None:
        await strike("detokenize")
        await super().handle(message, ctx)


class FaultyDeliver(Deliver):
    async def handle(self, message: Any, ctx: Any) -> None:
        await strike("deliver")
        await super().handle(message, ctx)


def fault_graph(
    stage: str,
    *,
    timeout_s: float | None = None,
    max_restarts: int | None = None,
    base: Path = DEFAULT_GRAPH,
) -> str:
    """The YAML of the `base` graph (the default one) with `stage` replaced by its faulty
    twin, its watchdog set to `timeout_s` and its group's intensity to `max_restarts`."""
    text = base.read_text()
    real = f"flowllm.stages.{stage}:{stage.capitalize()}"
    assert real in text, real
    text = text.replace(real, f"{__name__}:Faulty{stage.capitalize()}")  # this module
    if timeout_s is not None:
        lines = text.splitlines()
        at = next(i for i, line in enumerate(lines) if f"{{name: {stage}," in line)
        if lines[at + 1].strip().startswith("supervision:"):
            start = lines[at + 1].index("timeout_s:")
            end = lines[at + 1].index("}", start)
            lines[at + 1] = lines[at + 1][:start] + f"timeout_s: {timeout_s}" + lines[at + 1][end:]
        text = "\n".join(lines) + "\n"
    if max_restarts is not None:
        text = text.replace("timeout_s:", f"max_restarts: {max_restarts}, timeout_s:")
    return text
