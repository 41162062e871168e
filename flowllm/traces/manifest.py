"""A trace's manifest: what was recorded and how to rebuild the engine that recorded it.

`manifest.json` sits beside the channel files. It names the schema version (a reader
refuses any other), the flowllm version, the model (name, HF config, the sha256 of its
weights and, for the test models, the seeded builder that recreates them), the engine
config, the dtype, the graph (as YAML) and, per channel, its file, message type,
producers, consumer and entry count.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import msgspec
import yaml

from flowllm.config import EngineConfig
from flowllm.graph.spec import GraphSpec
from flowllm.graph.validator import ValidGraph, validate_graph

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
SPANS_FILE = "spans.msgpack"


class TraceSchemaError(ValueError):
    """A trace written with another schema version (or not a trace at all)."""


class ModelSource(msgspec.Struct, frozen=True, kw_only=True):
    """How to recreate the model's directory: `MODEL_BUILDERS[builder](dest, **kwargs)`.

    Builders are named, never imported from a trace: a trace file cannot make replay run
    code of its choosing.
    """

    builder: str
    kwargs: dict[str, Any] = {}


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    path: str  # where it was loaded from when recording
    hf_config: dict[str, Any] = {}
    weights_sha256: str | None = None
    source: ModelSource | None = None


class ChannelInfo(msgspec.Struct, kw_only=True):
    name: str  # "stage.port" of the consumer
    file: str
    message_type: str
    consumer: str
    producers: list[str]
    count: int = 0
    bytes: int = 0


class Manifest(msgspec.Struct, kw_only=True):
    schema_version: int
    flowllm_version: str
    model: ModelInfo
    engine_config: EngineConfig
    dtype: str
    graph_yaml: str
    channels: dict[str, ChannelInfo]
    spans: bool = True
    digest_k: int = 0  # 0: tensors in full; k: logits as top-k digests
    max_bytes: int | None = None
    truncated: bool = False  # recording stopped early (max_bytes, or the writer fell behind)
    stop_reason: str | None = None
    description: str = ""

    def graph(self) -> ValidGraph:
        return validate_graph(GraphSpec.from_yaml(self.graph_yaml, source="<trace manifest>"))


def graph_yaml(graph: ValidGraph) -> str:
    """The graph as YAML a `GraphSpec` reads back."""
    spec = graph.spec
    data = {
        "graph": spec.name,
        "stages": [
            {"name": s.name, "use": s.use, "with": dict(s.params), "replicas": s.replicas}
            for s in spec.stages
        ],
        "edges": [
            {"from": str(e.src), "to": str(e.dst), "capacity": e.capacity} for e in spec.edges
        ],
    }
    text: str = yaml.safe_dump(data, sort_keys=False)
    return text


def weights_sha256(model_dir: Path) -> str | None:
    """sha256 over the directory's *.safetensors files (sorted by name)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def write_manifest(trace_dir: Path, manifest: Manifest) -> None:
    data = msgspec.json.format(msgspec.json.encode(manifest), indent=2)
    (trace_dir / MANIFEST).write_bytes(data + b"\n")


def read_manifest(trace_dir: str | Path) -> Manifest:
    """The manifest of a trace directory; TraceSchemaError for another schema version."""
    path = Path(trace_dir) / MANIFEST
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceSchemaError(f"{trace_dir} is not a flowllm trace: no {MANIFEST}") from e
    try:
        head = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise TraceSchemaError(f"{path} is not valid JSON: {e}") from None
    version = head.get("schema_version") if isinstance(head, dict) else None
    if version != SCHEMA_VERSION:
        raise TraceSchemaError(
            f"{trace_dir} is a trace of schema version {version}; this flowllm reads schema "
            f"version {SCHEMA_VERSION} only. Record it again (`make traces` for the committed "
            f"ones)."
        )
    model = head.get("engine_config", {}).get("model")
    if isinstance(model, dict) and "quantization" not in model:
        # Recorded before GGUF weights could be served quantized: they ran dequantized.
        model["quantization"] = "none"
    try:
        return msgspec.convert(head, type=Manifest)
    except msgspec.ValidationError as e:
        raise TraceSchemaError(f"{path}: {e}") from None
