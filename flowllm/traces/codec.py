"""Trace file encoding: msgspec msgpack, messages tagged by type, tensors made explicit.

A channel file is a sequence of frames, each a 4-byte little-endian length followed by one
msgpack entry `[type_name, send_time, message, object_id]` (`send_time` is the sender's
`perf_counter()`; `object_id` is the message object's `id()`, which lets a span recorded
by the consuming stage be matched with the entry it handled, offline). Messages are the Structs of
`flowllm.messages`; a tensor inside one (the `Any` fields of `StepLogits` and `StepHidden`)
is a msgpack extension holding its dtype, shape and raw little-endian bytes (`EXT_TENSOR`),
or, when the recorder was asked for compact logits, a `TensorDigest` (`EXT_DIGEST`): each
row's top-k entries plus its sum and sum of squares, enough to check a replayed tensor but
not to replay from. An integer tensor (a token bitmask) is always whole, zlib-compressed
(`EXT_ZTENSOR`).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np
import torch

from flowllm import messages as M

EXT_TENSOR = 1
EXT_DIGEST = 2
EXT_ZTENSOR = 3
_FRAME = struct.Struct("<I")

# Every message type a channel may carry, by name (the tag written with each entry).
MESSAGE_TYPES: dict[str, type[msgspec.Struct]] = {
    cls.__name__: cls
    for cls in (
        M.GenerateRequest,
        M.ValidRequest,
        M.TokenizedRequest,
        M.Abort,
        M.Finish,
        M.RequestError,
        M.StepBatch,
        M.StepLogits,
        M.StepHidden,
        M.StepMasks,
        M.SampledIds,
        M.StepTokens,
        M.ChoiceEvents,
        M.TextDeltas,
        M.Chunk,
    )
}

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


class TraceFormatError(ValueError):
    """A trace file is not what this version of flowllm writes."""


class _TensorHeader(msgspec.Struct, array_like=True):
    dtype: str
    shape: tuple[int, ...]
    data: bytes


class TensorDigest(msgspec.Struct, array_like=True, kw_only=True):
    """A compact stand-in for a 2-D float tensor: per row, its top-k and two moments.

    shape: [rows, cols]; indices/values: [rows][k] (largest first); sums/sumsqs: [rows].
    """

    dtype: str
    shape: tuple[int, ...]
    indices: list[list[int]]
    values: list[list[float]]
    sums: list[float]
    sumsqs: list[float]

    @classmethod
    def of(cls, tensor: torch.Tensor, k: int) -> TensorDigest:
        """The digest of `tensor` ([rows, cols], or 1-D as one row)."""
        t = tensor.detach().to("cpu")
        if not t.is_floating_point():
            t = t.to(torch.float64)
        rows = t.reshape(1, -1) if t.dim() < 2 else t.flatten(1)  # [rows, cols]
        k = min(k, rows.shape[1]) if rows.numel() else 0
        if rows.shape[0] and k:
            values, indices = torch.topk(rows, k, dim=1)
        else:
            values = indices = torch.empty(rows.shape[0], 0)
        # Moments accumulated in float64 without a float64 copy of the whole tensor.
        norms = torch.linalg.vector_norm(rows, 2, dim=1, dtype=torch.float64)
        return cls(
            dtype=str(tensor.dtype).removeprefix("torch."),
            shape=tuple(tensor.shape),
            indices=indices.to(torch.int64).tolist(),
            values=values.to(torch.float64).tolist(),
            sums=rows.sum(dim=1, dtype=torch.float64).tolist(),
            sumsqs=(norms * norms).tolist(),
        )


def encode_tensor(tensor: torch.Tensor) -> bytes:
    """dtype, shape and the raw bytes of a CPU copy (bfloat16 travels as its 16 bits)."""
    t = tensor.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise TraceFormatError(f"cannot encode a tensor of dtype {name}")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    data = raw.numpy().astype(raw.numpy().dtype.newbyteorder("<"), copy=False).tobytes()
    return msgspec.msgpack.encode(_TensorHeader(name, tuple(t.shape), data))


def decode_tensor(payload: bytes) -> torch.Tensor:
    header = msgspec.msgpack.decode(payload, type=_TensorHeader)
    if header.dtype not in _TORCH_DTYPES:
        raise TraceFormatError(f"unknown tensor dtype {header.dtype!r} in a trace")
    if header.dtype == "bfloat16":
        array = np.frombuffer(header.data, dtype="<i2").copy()
        return torch.from_numpy(array).view(torch.bfloat16).reshape(header.shape)
    np_dtype = torch.empty(0, dtype=_TORCH_DTYPES[header.dtype]).numpy().dtype
    array = np.frombuffer(header.data, dtype=np_dtype.newbyteorder("<")).copy()
    return torch.from_numpy(array.astype(np_dtype, copy=False)).reshape(header.shape)


class Entry(NamedTuple):
    """One recorded send."""

    message: Any
    send_time: float
    object_id: int


class MessageCodec:
    """Encodes and decodes trace entries; one per writer or reader (reuses msgspec objects).

    `digest_k`: 0 writes tensors in full; k > 0 writes a `TensorDigest` with each row's
    top k instead (compact logits).
    """

    def __init__(self, digest_k: int = 0) -> None:
        self.digest_k = digest_k
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._entry = msgspec.msgpack.Decoder(tuple[str, float, msgspec.Raw, int])
        self._decoders = {
            name: msgspec.msgpack.Decoder(cls, ext_hook=self._ext_hook)
            for name, cls in MESSAGE_TYPES.items()
        }

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if not obj.is_floating_point():  # token bitmasks: mostly runs of 0 and -1
                return msgspec.msgpack.Ext(EXT_ZTENSOR, zlib.compress(encode_tensor(obj)))
            if self.digest_k:
                digest = TensorDigest.of(obj, self.digest_k)
                return msgspec.msgpack.Ext(EXT_DIGEST, msgspec.msgpack.encode(digest))
            return msgspec.msgpack.Ext(EXT_TENSOR, encode_tensor(obj))
        raise NotImplementedError(f"cannot encode {type(obj).__name__} in a trace")

    @staticmethod
    def _ext_hook(code: int, data: memoryview) -> Any:
        if code == EXT_TENSOR:
            return decode_tensor(bytes(data))
        if code == EXT_ZTENSOR:
            return decode_tensor(zlib.decompress(data))
        if code == EXT_DIGEST:
            return msgspec.msgpack.decode(data, type=TensorDigest)
        raise TraceFormatError(f"unknown msgpack extension {code} in a trace")

    def encode(self, message: Any, send_time: float, object_id: int = 0) -> bytes:
        """One framed entry."""
        name = type(message).__name__
        if name not in MESSAGE_TYPES:
            raise TraceFormatError(f"{name} is not a flowllm message type")
        body = self._encoder.encode((name, send_time, message, object_id))
        return _FRAME.pack(len(body)) + body

    def encode_value(self, value: Any) -> bytes:
        """One framed msgpack value (span records)."""
        body = self._encoder.encode(value)
        return _FRAME.pack(len(body)) + body

    def decode(self, body: bytes | memoryview) -> Entry:
        """The entry in one unframed frame."""
        try:
            name, send_time, raw, object_id = self._entry.decode(body)
        except msgspec.DecodeError as e:
            raise TraceFormatError(f"malformed trace entry: {e}") from None
        decoder = self._decoders.get(name)
        if decoder is None:
            raise TraceFormatError(f"unknown message type {name!r} in a trace")
        return Entry(decoder.decode(raw), send_time, object_id)


def iter_frames(path: Path) -> Iterator[memoryview]:
    """The frames of a trace file; a truncated last frame (a crash mid-write) is ignored."""
    data = memoryview(path.read_bytes())
    offset = 0
    while offset + _FRAME.size <= len(data):
        (length,) = _FRAME.unpack_from(data, offset)
        start = offset + _FRAME.size
        if start + length > len(data):
            return
        yield data[start : start + length]
        offset = start + length


def read_channel(path: Path, codec: MessageCodec | None = None) -> list[Entry]:
    """Every entry of one channel file, in send order."""
    codec = codec or MessageCodec()
    return [codec.decode(frame) for frame in iter_frames(path)]


def snapshot(message: Any) -> Any:
    """A copy safe to encode later: tensors are cloned (a consumer may edit them in place)."""
    if isinstance(message, M.StepLogits):
        return M.StepLogits(
            batch=message.batch,
            logits=message.logits.detach().clone(),
            prompt_logits={k: v.detach().clone() for k, v in message.prompt_logits.items()},
        )
    if isinstance(message, M.StepHidden):
        return M.StepHidden(batch=message.batch, hidden=message.hidden.detach().clone())
    return message
