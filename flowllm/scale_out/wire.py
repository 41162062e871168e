"""What a replica streams back to the ingress for one API request: msgpack-encoded events.

A replica answers a `generate` call with a stream of events: the request's chunks as the
graph produces them, a `RequestError` for a sub-request the graph refused, or one
`Refused` when the whole request was not admitted (the ingress turns it into the same
answer a single server gives: 503 with Retry-After, or the 400 of a request that could
never be admitted).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from flowllm.messages import Chunk, GenerateRequest, RequestError


class Refused(msgspec.Struct, frozen=True, tag=True):
    """Admission said no to every sub-request: overloaded now (`error` None), or never."""

    retry_after: float = 1.0
    error: RequestError | None = None


class ChunkEvent(msgspec.Struct, frozen=True, tag=True):
    chunk: Chunk


class ErrorEvent(msgspec.Struct, frozen=True, tag=True):
    error: RequestError


Event = Refused | ChunkEvent | ErrorEvent

_ENCODER = msgspec.msgpack.Encoder()
_EVENT_DECODER = msgspec.msgpack.Decoder(Event)


class Submission(msgspec.Struct, frozen=True):
    """One API request's sub-requests, and how long they already waited in the ingress:
    `arrival_time` is a monotonic clock reading, which means nothing on another machine,
    so the replica dates the arrival back by `waited` on its own clock."""

    requests: list[GenerateRequest]
    waited: float


_SUBMISSION_DECODER = msgspec.msgpack.Decoder(Submission)


def encode_submission(requests: Sequence[GenerateRequest]) -> bytes:
    now = time.monotonic()
    waited = max((now - r.arrival_time for r in requests), default=0.0)
    return _ENCODER.encode(Submission(list(requests), max(0.0, waited)))


def decode_submission(payload: bytes) -> list[GenerateRequest]:
    """The sub-requests, their arrival dated on this process's clock."""
    submission = _SUBMISSION_DECODER.decode(payload)
    arrival = time.monotonic() - submission.waited
    return [msgspec.structs.replace(r, arrival_time=arrival) for r in submission.requests]


def encode_event(event: Event) -> bytes:
    return _ENCODER.encode(event)


def decode_event(payload: bytes) -> Event:
    return _EVENT_DECODER.decode(payload)  # type: ignore[no-any-return]
