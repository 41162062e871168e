"""How a channel's messages travel between processes: msgpack frames on a byte stream.

A frame is `[kind, channel, member, payload]`, msgpack-encoded behind a 4-byte length:

- `DATA`: one message of channel number `channel`; `member` is the index of its class in
  the channel's declared type (a union such as `TokenizedRequest | Abort` has two), and
  `payload` the message itself, so the receiver decodes it as exactly that class: the
  declared type is checked on both sides.
- `CREDIT`: the receiver took `member` messages of the channel into its own buffer; the
  sender may send that many more (flowllm/graph/remote.py).
- `END`: the sender's producers of the channel have all finished.
- `CONTROL`: a message for the processes' owners (hello, heartbeat), not for a stage.

Channels are numbered by their order in the validated graph, which both processes load
from the same file; the hello exchanges a digest of the wiring, so two processes running
different graphs refuse each other instead of misreading frames.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import typing
from collections.abc import Mapping
from typing import Any

import msgspec

from flowllm.graph.channel import type_members, type_name
from flowllm.graph.transport import receive

DATA, CREDIT, END, CONTROL = 0, 1, 2, 3
_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 256 * 2**20  # a frame longer than this is a broken peer, not a message


class WireError(RuntimeError):
    """A peer sent what this process cannot read (a corrupt or foreign stream)."""


class Frame(msgspec.Struct, array_like=True, frozen=True):
    kind: int
    channel: int
    member: int = 0
    payload: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil


def wire_problem(message_type: object) -> str | None:
    """Why messages of `message_type` cannot cross processes, or None when they can.

    Every member must be a class msgspec encodes; a field typed `Any` (a tensor, in the
    step loop's messages) has no encoding, so a channel carrying it must stay in one
    process.
    """
    try:
        members = type_members(message_type)
    except TypeError as exc:
        return str(exc)
    if members is None:
        return f"{type_name(message_type)} is not a declared type"
    for member in members:
        if issubclass(member, msgspec.Struct):
            hints = typing.get_type_hints(member)
            untyped = [f.name for f in msgspec.structs.fields(member) if hints[f.name] is Any]
            if untyped:
                return (
                    f"{member.__name__}.{', '.join(untyped)} is typed Any (a tensor?), which "
                    "has no wire encoding"
                )
        try:
            msgspec.msgpack.Decoder(member)
        except TypeError as exc:
            return f"{member.__name__} cannot be decoded from msgpack: {exc}"
    return None


class ChannelCodec:
    """Encodes one channel's messages, and decodes them as the class they were sent as."""

    __slots__ = ("_decoders", "_index", "name")

    def __init__(self, name: str, message_type: object) -> None:
        problem = wire_problem(message_type)
        if problem is not None:
            raise TypeError(f"channel {name!r} cannot cross processes: {problem}")
        members = type_members(message_type) or ()
        self.name = name
        self._index = {member: i for i, member in enumerate(members)}
        self._decoders: list[msgspec.msgpack.Decoder[Any]] = [
            msgspec.msgpack.Decoder(member) for member in members
        ]

    def member(self, message: object) -> int:
        try:
            return self._index[type(message)]
        except KeyError:
            raise TypeError(
                f"channel {self.name!r} does not carry {type(message).__name__}"
            ) from None

    def decode(self, member: int, payload: msgspec.Raw) -> object:
        try:
            return self._decoders[member].decode(payload)
        except (IndexError, msgspec.DecodeError) as exc:
            raise WireError(f"channel {self.name!r}: undecodable message: {exc}") from None


def wiring_digest(channels: dict[str, Any]) -> str:
    """A digest of the channels' names, order and types: equal graphs, equal digests."""
    text = "\n".join(f"{name}:{type_name(spec.message_type)}" for name, spec in channels.items())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def channel_codecs(channels: Mapping[str, Any]) -> dict[str, tuple[int, ChannelCodec]]:
    """The wire number and codec of every channel that crosses processes (`ChannelSpec`s
    by name, in the validated graph's order, which both ends share)."""
    return {
        name: (number, ChannelCodec(name, spec.message_type))
        for number, (name, spec) in enumerate(channels.items())
        if spec.crosses
    }


_ENCODER = msgspec.msgpack.Encoder()
_FRAME_DECODER = msgspec.msgpack.Decoder(Frame)


def encode_frame(kind: int, channel: int, member: int = 0, message: object = None) -> bytes:
    """One frame, length-prefixed, ready to write."""
    payload = msgspec.Raw(_ENCODER.encode(message))
    body = _ENCODER.encode(Frame(kind, channel, member, payload))
    return _LENGTH.pack(len(body)) + body


def encode_control(message: object) -> bytes:
    return encode_frame(CONTROL, 0, 0, message)


class FrameReader:
    """The frames in a byte stream, from its chunks as they arrive (a frame may span
    several chunks); raises WireError on a malformed stream."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[Frame]:
        """The frames that `chunk` completes, in order."""
        buffer = self._buffer
        buffer += chunk
        frames: list[Frame] = []
        start = 0
        while len(buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, start)
            if length > MAX_FRAME_BYTES:
                raise WireError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
            end = start + _LENGTH.size + length
            if end > len(buffer):
                break
            try:
                # A copy of the frame: its Raw payload points into it, not into `buffer`.
                frames.append(_FRAME_DECODER.decode(bytes(buffer[start + _LENGTH.size : end])))
            except msgspec.DecodeError as exc:
                raise WireError(f"malformed frame: {exc}") from None
            start = end
        del buffer[:start]
        return frames


async def read_one_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> Frame:
    """Exactly one frame of at most `max_bytes`, reading no byte past it (a greeting,
    before the socket is handed to a `Peer`); raises WireError on a malformed or longer
    one, `anyio.EndOfStream` if the connection ends."""
    head = await _receive_exactly(sock, _LENGTH.size)
    (length,) = _LENGTH.unpack(head)
    if length > max_bytes:
        raise WireError(f"a frame of {length} bytes (at most {max_bytes})")
    try:
        return _FRAME_DECODER.decode(await _receive_exactly(sock, length))
    except msgspec.DecodeError as exc:
        raise WireError(f"malformed frame: {exc}") from None


async def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        data += await receive(sock, size - len(data))
    return bytes(data)
