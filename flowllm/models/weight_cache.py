"""A quantized GGUF model's weights as the kernels read them, cached on disk beside the
directory converted from the file, so that a warm start maps them instead of reading the
file again.

Why: loading the bundled model from its GGUF file parses the file's metadata (gguf's
reader walks each of the vocabulary's 49,152 tokens and merges, field by field in Python),
repacks every tensor's blocks into the kernels' code layouts, undoes llama.cpp's Q/K row
order, fuses q/k/v and gate/up and interleaves each 16 rows, none of which a warm start
needs to redo (benchmarks/README.md, "Start-up", has the figures). An entry holds the
result: each layer's codes, scales and offsets as its product reads them, and the model's
other parameters (norms, biases). A warm load builds the model, points its layers at the
entry's mapped bytes (the page cache shares them between processes, and the file is read
as the model touches it) and copies the few parameters.

Key: the source file's name, size and modification time, as the converted directory
beside the entry is keyed (bundled.py): a file changed behind those would leave that
directory stale too, and hashing the whole file would read all of it at every start; the
kernel build (`NativeLibrary.build_id`, "torch" without the library), a digest of the
Python modules that decide the layout (repacking, fusing, interleaving), the format, the
model class and dtype. A change to any of them rebuilds the entry, never loads a layout
the code no longer reads.

Trust: an entry serves only when its header parses, its key matches, the file has exactly
the length the header gives, and every tensor fits its layer or parameter (shape, dtype,
format); otherwise the weights are repacked from the file and the entry written again. The
bytes are not checksummed (that would read the whole file at every start): the entry is
written whole under a temporary name, flushed, then renamed over the old one, so a crash
leaves the old entry or none, never part of one. A directory that cannot be written only
costs the repacking.

Room: a directory keeps its KEEP most recently used entries (a served entry is touched),
enough for the builds and dtypes in use and the last versions of the code; writing one
removes the oldest beyond them (a process that maps a removed entry keeps its pages).

Format: 8 magic bytes, the header's length (uint64, little-endian), the header (JSON,
padded with spaces), then the tensors, each at a multiple of 64 bytes from the start of
the file as torch allocates them (safetensors, which lays tensors end to end, cannot
align them).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import structlog
import torch

from flowllm.kernels import native, quant_linear
from flowllm.kernels.quant_linear import QuantizedLinear, QuantizedWeight
from flowllm.models import gguf_file, layers
from flowllm.models.causal_lm import PagedCausalLM
from flowllm.models.layers import Embedding, Linear

FORMAT = 1
MAGIC = b"FLOWLLMW"
ALIGN = 64
SUFFIX = ".weights"
KEEP = 4  # entries a directory keeps, the most recently used
# Temporary files older than this are leftovers of a crashed write.
_STALE_TMP_SECONDS = 3600.0
_DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32)
}
# The modules whose code decides the cached layout (with the model class's own).
_LAYOUT_MODULES = (quant_linear, gguf_file, layers, sys.modules[__name__])

_log = structlog.get_logger("flowllm.models")

QuantizedLayer = Linear | Embedding


class StaleEntry(ValueError):
    """The entry cannot serve this model: absent, stale, or not what it should be."""


def load(model: PagedCausalLM, source: Path, directory: Path, repack: Callable[[], None]) -> bool:
    """Fill `model` (built, not loaded) from its entry in `directory` for the GGUF file
    `source`; where there is none that serves, `repack()` loads it from the file and the
    entry is written. Returns whether the entry served."""
    started = time.perf_counter()
    path = entry_path(model, directory)
    try:
        restore(model, source, path)
    except StaleEntry as why:
        _log.info("repacking the weights (cached for the next start)", reason=str(why))
        repack()
        store(model, source, path)
        return False
    with contextlib.suppress(OSError):  # used now: the last to be evicted
        os.utime(path)
    seconds = round(time.perf_counter() - started, 3)
    _log.info("repacked weights mapped from the cache", entry=str(path), seconds=seconds)
    return True


def entry_path(model: PagedCausalLM, directory: Path) -> Path:
    """Where `model`'s entry lives in `directory`: one per dtype and kernel build (so that
    builds and dtypes do not evict each other), whatever the source."""
    lib = native.library()
    digest = hashlib.sha256(json.dumps(_build_key(model)).encode()).hexdigest()[:16]
    dtype = str(model.dtype).removeprefix("torch.")
    return directory / f"{dtype}-{lib.isa if lib else 'torch'}-{digest}{SUFFIX}"


def entry_key(model: PagedCausalLM, source: Path) -> dict[str, Any]:
    """What an entry for `model` loaded from `source` must have been built from."""
    st = source.stat()
    return {
        "source": {"file": source.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns},
        **_build_key(model),
    }


def _build_key(model: PagedCausalLM) -> dict[str, Any]:
    lib = native.library()
    return {
        "format": FORMAT,
        "build": lib.build_id if lib is not None else "torch",
        "code": _layout_digest(type(model)),
        "model": type(model).__name__,
        "dtype": str(model.dtype).removeprefix("torch."),
    }


@functools.cache
def _layout_digest(model_class: type) -> str:
    digest = hashlib.sha256()
    for module in (*_LAYOUT_MODULES, sys.modules[model_class.__module__]):
        digest.update(Path(str(module.__file__)).read_bytes())
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------------------
# Reading

# What a damaged entry can raise while it is read and fitted: it is then rebuilt.
_DAMAGE = (OSError, ValueError, LookupError, TypeError, AttributeError, RuntimeError)


def restore(model: PagedCausalLM, source: Path, path: Path) -> None:
    """Fill `model` from the entry at `path`; StaleEntry (the model untouched) when it does
    not serve."""
    try:
        with path.open("rb") as f:
            header, data = _read(f)
        if header["key"] != entry_key(model, source):
            raise StaleEntry("built from another file, kernel build or code")
        products, parameters = _fit(model, header, data)
    except FileNotFoundError:
        raise StaleEntry("no entry") from None
    except _DAMAGE as e:
        if isinstance(e, StaleEntry):
            raise
        raise StaleEntry(f"a damaged entry ({type(e).__name__}: {e})") from None
    for layer, product in products:
        layer.use_product(product)
    with torch.no_grad():
        for parameter, value in parameters:
            parameter.copy_(value)


def _read(f: IO[bytes]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and the tensors (views of the file mapped copy-on-write) of an entry."""
    head = f.read(len(MAGIC) + 8)
    if head[: len(MAGIC)] != MAGIC or len(head) < len(MAGIC) + 8:
        raise ValueError("not an entry")
    (length,) = struct.unpack("<Q", head[len(MAGIC) :])
    size = os.fstat(f.fileno()).st_size
    if len(head) + length > size:
        raise ValueError("truncated in its header")
    header = json.loads(f.read(length))
    start = _aligned(len(head) + length)
    if start + header["data_bytes"] != size:
        raise ValueError(f"{size} bytes where the header says {start + header['data_bytes']}")
    mapped = torch.from_numpy(np.memmap(f, dtype=np.uint8, mode="c"))
    tensors = {}
    for name, (dtype, shape, offset) in header["tensors"].items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype].itemsize
        if offset % ALIGN or not 0 <= offset <= offset + nbytes <= header["data_bytes"]:
            raise ValueError(f"tensor {name} lies outside the file")
        raw = mapped[start + offset : start + offset + nbytes]
        tensors[name] = raw.view(_DTYPES[dtype]).view(shape)
    return header, tensors


def _fit(
    model: PagedCausalLM, header: dict[str, Any], data: dict[str, torch.Tensor]
) -> tuple[list[tuple[QuantizedLayer, QuantizedLinear]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each quantized layer's product over its entry weight and each parameter's value,
    checked against the model (which is left as it is)."""
    weights = [
        QuantizedWeight(
            codes=data[w["codes"]],
            scales=data[w["scales"]],
            mins=None if w["mins"] is None else data[w["mins"]],
            kind=w["kind"],
            group=int(w["group"]),
            source=str(w["source"]),
            interleaved=bool(w["interleaved"]),
        )
        for w in header["weights"]
    ]
    layers_ = dict(_quantized_layers(model))
    if set(layers_) != set(header["layers"]):
        raise ValueError("its layers are not the model's")
    products = [
        (layer, layer.quantized_product(weights[header["layers"][name]]))
        for name, layer in layers_.items()
    ]
    # The parameters left once the layers run quantized (their plain weights freed).
    parameters = {
        name: p
        for name, p in model.named_parameters()
        if name.removesuffix(".weight") not in layers_
    }
    if set(parameters) != set(header["parameters"]):
        raise ValueError("its parameters are not the model's")
    values: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, parameter in parameters.items():
        value = data[header["parameters"][name]]
        if value.shape != parameter.shape or value.dtype != parameter.dtype:
            raise ValueError(f"{name} is {value.dtype} {tuple(value.shape)}")
        values.append((parameter, value))
    return products, values


def _quantized_layers(model: PagedCausalLM) -> Iterator[tuple[str, QuantizedLayer]]:
    for name, module in model.named_modules():
        if isinstance(module, (Linear, Embedding)):
            yield name, module


# ----------------------------------------------------------------------------------------
# Writing


def store(model: PagedCausalLM, source: Path, path: Path) -> None:
    """Write `model`'s entry (loaded from `source`) at `path`, atomically; a model with a
    layer that does not run quantized is not cached, and an entry that cannot be written
    is only logged."""
    tensors: dict[str, torch.Tensor] = {}
    weights: list[dict[str, Any]] = []
    index_of: dict[int, int] = {}  # id(weight) -> its index: a tied head shares the table's
    layer_weights: dict[str, int] = {}
    for name, layer in _quantized_layers(model):
        if layer.quantized is None:
            _log.info("weights not cached: a layer runs unquantized", layer=name)
            return
        w = layer.quantized.weight
        if id(w) not in index_of:
            index_of[id(w)] = len(weights)
            entry: dict[str, Any] = {
                "kind": w.kind, "group": w.group, "source": w.source, "interleaved": w.interleaved
            }  # fmt: skip
            for part, t in (("codes", w.codes), ("scales", w.scales), ("mins", w.mins)):
                entry[part] = None if t is None else f"weights.{len(weights)}.{part}"
                if t is not None:
                    tensors[entry[part]] = t
            weights.append(entry)
        layer_weights[name] = index_of[id(w)]
    parameters = {name: f"parameters.{name}" for name, _ in model.named_parameters()}
    tensors |= {parameters[name]: p.detach() for name, p in model.named_parameters()}
    header = {
        "key": entry_key(model, source),
        "weights": weights,
        "layers": layer_weights,
        "parameters": parameters,
    }
    try:
        _write_atomically(path, header, tensors)
    except OSError as e:
        _log.warning("cannot cache the repacked weights", entry=str(path), error=str(e))


def _write_atomically(path: Path, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            _write(f, header, tensors)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's file is private; the model directory is not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _evict(path.parent)


def _evict(directory: Path) -> None:
    """Remove the entries beyond the KEEP most recently used."""
    entries = []
    for entry in directory.glob(f"*{SUFFIX}"):
        with contextlib.suppress(OSError):
            entries.append((entry.stat().st_mtime_ns, entry))
    for _, entry in sorted(entries, reverse=True)[KEEP:]:
        entry.unlink(missing_ok=True)


def _write(f: IO[bytes], header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """The magic, the header with each tensor's offset in the data, then the data: each
    tensor at a multiple of ALIGN bytes from the start of the file."""
    places: dict[str, list[Any]] = {}
    offset = 0
    for name, t in tensors.items():
        places[name] = [str(t.dtype).removeprefix("torch."), list(t.shape), offset]
        offset = _aligned(offset + t.numel() * t.element_size())
    text = json.dumps({**header, "tensors": places, "data_bytes": offset}).encode()
    f.write(MAGIC + struct.pack("<Q", len(text)) + text)
    start = _aligned(len(MAGIC) + 8 + len(text))
    for name, t in tensors.items():
        f.seek(start + places[name][2])
        f.write(t.contiguous().view(torch.uint8).reshape(-1).numpy().data)
    f.truncate(start + offset)


def _aligned(offset: int) -> int:
    return offset + (-offset % ALIGN)


def _remove_stale_temporaries(directory: Path) -> None:
    now = time.time()
    for p in directory.glob(f".*{SUFFIX}.*.tmp"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_SECONDS:
                p.unlink()
        except OSError:
            continue
