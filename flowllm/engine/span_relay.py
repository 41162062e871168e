"""Spans recorded in the engine core, carried to the fronts' span sinks.

The fronts hold every span sink (OpenTelemetry export, the web page's request timelines,
a trace recorder), so the core's stages' spans travel to them: while any front asks for
spans (`WantSpans`), the core batches each span with its message and sends the batch
with its next heartbeat. Tensors stay behind: a span's message crosses without its
logits or masks, which no sink reads.
"""

from __future__ import annotations

from typing import Any

import msgspec

from flowllm.graph.spans import InputClosed
from flowllm.messages import (
    Abort,
    ChoiceEvents,
    Finish,
    RequestError,
    StepBatch,
    StepLogits,
    StepMasks,
    StepTokens,
    TokenizedRequest,
)

# The messages a core stage handles, by wire number (-1: an input that closed).
KINDS: tuple[type[Any], ...] = (
    TokenizedRequest,
    Abort,
    Finish,
    StepBatch,
    StepLogits,
    StepMasks,
    StepTokens,
    ChoiceEvents,
    RequestError,
)
_KIND = {kind: number for number, kind in enumerate(KINDS)}
_DECODERS = [msgspec.msgpack.Decoder(kind) for kind in KINDS]
_ENCODER = msgspec.msgpack.Encoder()
CLOSED_KIND = -1
MAX_PENDING = 4096  # spans waiting for the next heartbeat; more are dropped (counted)


class RemoteSpan(msgspec.Struct, array_like=True, frozen=True):
    stage: str
    kind: int
    message: msgspec.Raw
    started: float
    duration: float
    queue_wait: float


class Spans(msgspec.Struct, frozen=True, tag=True):
    spans: list[RemoteSpan]
    dropped: int = 0


class WantSpans(msgspec.Struct, frozen=True, tag=True):
    want: bool


def _without_tensors(message: object) -> object:
    if isinstance(message, StepLogits):
        return msgspec.structs.replace(message, logits=None, prompt_logits={})
    if isinstance(message, StepMasks):
        return msgspec.structs.replace(message, bitmask=None)
    return message


class SpanBatcher:
    """The core's span sink: batches spans while a front wants them."""

    def __init__(self) -> None:
        self.wanted = False
        self._pending: list[RemoteSpan] = []
        self._dropped = 0

    def __call__(
        self, stage: str, message: object, started: float, duration: float, queue_wait: float
    ) -> None:
        if not self.wanted:
            return
        if len(self._pending) >= MAX_PENDING:
            self._dropped += 1
            return
        if isinstance(message, InputClosed):
            kind, payload = CLOSED_KIND, _ENCODER.encode(message.port)
        else:
            kind = _KIND.get(type(message), -2)
            if kind < 0:
                return  # a message no sink reads across processes
            payload = _ENCODER.encode(_without_tensors(message))
        self._pending.append(
            RemoteSpan(stage, kind, msgspec.Raw(payload), started, duration, queue_wait)
        )

    def take(self) -> Spans | None:
        if not self._pending and not self._dropped:
            return None
        batch = Spans(self._pending, self._dropped)
        self._pending, self._dropped = [], 0
        return batch


def decode_span(span: RemoteSpan) -> object:
    """The message of a relayed span, as the class it was recorded with."""
    if span.kind == CLOSED_KIND:
        return InputClosed(msgspec.msgpack.decode(span.message, type=str))
    return _DECODERS[span.kind].decode(span.message)
