"""Record a running graph's channel traffic and spans into a trace directory.

Taps and the span sink only append to a queue (a tensor-carrying message is cloned first,
because its consumer may edit the tensor in place); a writer thread encodes and writes,
so recording never blocks the event loop on I/O or encoding. Once `max_bytes` would be
exceeded, recording stops for good: files end on a whole entry and the manifest says
`truncated`.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Collection
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from flowllm.graph.channel import type_name
from flowllm.graph.runtime import Graph
from flowllm.graph.spans import InputClosed, message_fields
from flowllm.traces.codec import MessageCodec, snapshot
from flowllm.traces.manifest import (
    SCHEMA_VERSION,
    SPANS_FILE,
    ChannelInfo,
    Manifest,
    ModelInfo,
    ModelSource,
    graph_yaml,
    weights_sha256,
    write_manifest,
)
from flowllm.version import __version__


class TraceError(RuntimeError):
    """A recording could not be set up (unknown channel, directory not writable)."""


class SpanRecord(msgspec.Struct, array_like=True, kw_only=True):
    """One span as the trace stores it (times from `perf_counter()`, seconds)."""

    stage: str
    started: float
    duration: float
    queue_wait: float
    object_id: int  # id() of the message handled: matches a channel entry's object_id
    request_id: str | None = None
    step_id: int | None = None
    closed_port: str | None = None  # set instead of a message: this input port ended


_STOP = object()


class TraceRecorder:
    """Records one graph run into `trace_dir` (one file per channel, spans, a manifest).

    `channels`: channel names ("stage.port") to record, default all. `max_bytes`: stop
    recording once the files would exceed it. `digest_k` > 0 stores tensors as top-k
    digests (compact; replay re-derives them from the producing stage). `model_source`
    tells replay how to rebuild the model (see ModelSource). `max_backlog`: entries queued
    for the writer at most; past it recording stops (truncated) instead of holding more.
    """

    def __init__(
        self,
        trace_dir: str | Path,
        *,
        channels: Collection[str] | None = None,
        max_bytes: int | None = None,
        digest_k: int = 0,
        spans: bool = True,
        model_source: ModelSource | None = None,
        description: str = "",
        max_backlog: int = 4096,
    ) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise TraceError(f"trace max bytes must be >= 1, got {max_bytes}")
        self.trace_dir = Path(trace_dir)
        self.channels = None if channels is None else tuple(channels)
        self.max_bytes = max_bytes
        self.digest_k = digest_k
        self.spans = spans
        self.model_source = model_source
        self.description = description
        self.bytes_written = 0
        self.truncated = False
        self.stop_reason: str | None = None
        self.max_backlog = max_backlog
        self._stopped = False  # read by taps: once set, they return at once
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._infos: list[ChannelInfo] = []
        self._manifest: Manifest | None = None
        self._error: BaseException | None = None

    # -- setup ----------------------------------------------------------------------------

    def attach(self, graph: Graph, services: Any) -> None:
        """Tap `graph`'s channels and spans (before it runs) and start the writer."""
        if self._thread is not None:
            raise TraceError("a TraceRecorder records one graph run; make a new one")
        names = list(graph.channels) if self.channels is None else list(self.channels)
        unknown = [n for n in names if n not in graph.channels]
        if unknown:
            raise TraceError(
                f"unknown trace channel(s) {', '.join(unknown)}; "
                f"this graph has {', '.join(graph.channels)}"
            )
        try:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            for old in self.trace_dir.glob("*.msgpack"):
                old.unlink()
        except OSError as e:
            raise TraceError(f"cannot write traces to {self.trace_dir}: {e}") from e
        specs = graph.spec.channels
        for index, name in enumerate(names):
            spec = specs[name]
            self._infos.append(
                ChannelInfo(
                    name=name,
                    file=f"{name}.msgpack",
                    message_type=type_name(spec.message_type),
                    consumer=spec.dst.stage,
                    producers=sorted({p.stage for p in spec.producers}),
                )
            )
            (self.trace_dir / self._infos[-1].file).write_bytes(b"")  # present even if unused
            graph.channels[name].add_tap(self._tap(index))
        if self.spans:
            graph.span_sinks.add(self._span)
        self._manifest = self._base_manifest(graph, services)
        write_manifest(self.trace_dir, self._manifest)  # rewritten with counts on close
        self._thread = threading.Thread(target=self._write_loop, name="trace-writer", daemon=True)
        self._thread.start()

    def _base_manifest(self, graph: Graph, services: Any) -> Manifest:
        config = services.config
        path = Path(config.model.model)
        hf_config: dict[str, Any] = {}
        sha = None
        if path.is_dir():
            config_file = path / "config.json"
            if config_file.is_file():
                hf_config = json.loads(config_file.read_text())
            sha = weights_sha256(path)
        dtype = config.model.dtype
        params = getattr(services.model, "parameters", None)
        if callable(params):
            first = next(iter(params()), None)
            if first is not None:
                dtype = str(first.dtype).removeprefix("torch.")
        return Manifest(
            schema_version=SCHEMA_VERSION,
            flowllm_version=__version__,
            model=ModelInfo(
                name=config.model.name,
                path=str(config.model.model),
                hf_config=hf_config,
                weights_sha256=sha,
                source=self.model_source,
            ),
            engine_config=config,
            dtype=dtype,
            graph_yaml=graph_yaml(graph.spec),
            channels={info.name: info for info in self._infos},
            spans=self.spans,
            digest_k=self.digest_k,
            max_bytes=self.max_bytes,
            description=self.description,
        )

    # -- the hot path: append to a queue, nothing else --------------------------------------

    def _tap(self, index: int) -> Any:
        put = self._queue.put

        def tap(message: Any, send_time: float) -> None:
            if self._stopped:
                return
            if self._queue.qsize() >= self.max_backlog:
                # The writer cannot keep up: stop rather than hold ever more copies.
                self._stop("the trace writer fell behind the graph")
                return
            put((index, snapshot(message), send_time, id(message)))

        return tap

    def _stop(self, reason: str) -> None:
        if not self._stopped:
            self._stopped = True
            self.truncated = True
            self.stop_reason = reason

    def _span(
        self, stage: str, message: Any, started: float, duration: float, queue_wait: float
    ) -> None:
        if not self._stopped:
            self._queue.put((-1, stage, message, started, duration, queue_wait))

    # -- the writer thread ----------------------------------------------------------------

    def _write_loop(self) -> None:
        codec = MessageCodec(self.digest_k)
        files: dict[int, BinaryIO] = {}
        get = self._queue.get
        try:
            while True:
                item = get()
                if item is _STOP:
                    return
                if self._stopped:
                    continue
                index = item[0]
                if index < 0:
                    _, stage, message, started, duration, wait = item
                    if isinstance(message, InputClosed):
                        record = SpanRecord(
                            stage=stage,
                            started=started,
                            duration=0.0,
                            queue_wait=0.0,
                            object_id=0,
                            closed_port=message.port,
                        )
                        data = codec.encode_value(record)
                        key, name = -1, SPANS_FILE
                        self._write(files, key, name, data, index)
                        continue
                    fields = message_fields(message)
                    record = SpanRecord(
                        stage=stage,
                        started=started,
                        duration=duration,
                        queue_wait=wait,
                        object_id=id(message),
                        request_id=fields.get("request_id"),
                        step_id=fields.get("step_id"),
                    )
                    data = codec.encode_value(record)
                    key, name = -1, SPANS_FILE
                else:
                    _, message, send_time, object_id = item
                    data = codec.encode(message, send_time, object_id)
                    key, name = index, self._infos[index].file
                self._write(files, key, name, data, index)
        except BaseException as e:  # reported by close(); the graph itself keeps running
            self._error = e
            self._stop(f"the trace writer failed: {e!r}")
        finally:
            for out in files.values():
                out.close()

    def _write(
        self, files: dict[int, BinaryIO], key: int, name: str, data: bytes, index: int
    ) -> None:
        """Append one frame, unless it would pass max_bytes (then recording stops)."""
        if self.max_bytes is not None and self.bytes_written + len(data) > self.max_bytes:
            self._stop(f"reached the size limit of {self.max_bytes} bytes")
            return
        out = files.get(key)
        if out is None:
            out = files[key] = (self.trace_dir / name).open("ab")
        out.write(data)
        self.bytes_written += len(data)
        if index >= 0:
            self._infos[index].count += 1
            self._infos[index].bytes += len(data)

    def close(self) -> None:
        """Flush what is queued, close the files and write the final manifest."""
        if self._thread is None or self._manifest is None:
            return
        self._queue.put(_STOP)
        self._thread.join()
        self._thread = None
        self._manifest.truncated = self.truncated
        self._manifest.stop_reason = self.stop_reason
        write_manifest(self.trace_dir, self._manifest)
        if self._error is not None:
            raise TraceError(f"trace writer failed: {self._error!r}") from self._error
