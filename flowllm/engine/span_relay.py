"""Spans recorded in the engine core, carried to the fronts' span sinks.

The fronts hold every span sink (OpenTelemetry export, the web page's request timelines,
a trace recorder), so the core's stages' spans travel to them: while any front asks for
spans (`WantSpans`, sent as its graph gains its first sink or loses its last), the core
sends each span with its message as it is recorded, behind the step's own outputs on the
same connection. Tensors stay behind: a span's message crosses without its logits or
masks, which no sink reads.
"""

from __future__ import annotations

from collections.abc import Callable
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


class RemoteSpan(msgspec.Struct, array_like=True, frozen=True):
    stage: str
    kind: int
    message: msgspec.Raw
    started: float
    duration: float
    queue_wait: float


class Spans(msgspec.Struct, frozen=True, tag=True):
    spans: list[RemoteSpan]


class WantSpans(msgspec.Struct, frozen=True, tag=True):
    want: bool


def _without_tensors(message: object) -> object:
    if isinstance(message, StepLogits):
        return msgspec.structs.replace(message, logits=None, prompt_logits={})
    if isinstance(message, StepMasks):
        return msgspec.structs.replace(message, bitmask=None)
    return message


class SpanRelay:
    """The core's span sink: hands each span to `send` while a front wants spans."""

    def __init__(self, send: Callable[[Spans], None]) -> None:
        self.wanted = False
        self._send = send

    def __call__(
        self, stage: str, message: object, started: float, duration: float, queue_wait: float
    ) -> None:
        if not self.wanted:
            return
        if isinstance(message, InputClosed):
            kind, payload = CLOSED_KIND, _ENCODER.encode(message.port)
        else:
            kind = _KIND.get(type(message), -2)
            if kind < 0:
                return  # a message no sink reads across processes
            payload = _ENCODER.encode(_without_tensors(message))
        span = RemoteSpan(stage, kind, msgspec.Raw(payload), started, duration, queue_wait)
        self._send(Spans([span]))


def decode_span(span: RemoteSpan) -> object:
    """The message of a relayed span, as the class it was recorded with."""
    if span.kind == CLOSED_KIND:
        return InputClosed(msgspec.msgpack.decode(span.message, type=str))
    return _DECODERS[span.kind].decode(span.message)
