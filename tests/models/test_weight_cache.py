"""The repacked-weight cache (flowllm/models/weight_cache.py): written by the first load of
a quantized GGUF model, mapped by the next without reading the file, its logits equal to a
fresh repack's bit for bit; rebuilt when the file, the kernel build or the entry's bytes
are not what it was built from; written whole or not at all. The bundled model end to
end: its entry beside the converted directory, tied head and table sharing one copy."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_fixtures import write_gguf
from kernel_builds import use_kernel_build
from model_test_utils import paged_logits
from structlog.testing import capture_logs
from test_model_equivalence import llama_reference, qwen_reference

from flowllm.config import BUNDLED_MODEL
from flowllm.kernels import quant_linear
from flowllm.models import gguf_file, loader, weight_cache
from flowllm.models.bundled import SOURCE_FILE, bundled_model_dir
from flowllm.models.layers import Embedding, Linear
from flowllm.models.loader import REPACKED_DIR, LoadedModel, ResolvedModel, load_model

BLOCK = 16
Q4_1, Q4_K = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K
TOKENS = [3, 141, 59, 265, 35, 89, 79, 323, 84, 62, 64, 33, 83, 279, 50, 288, 41, 97]


def logits_of(model: torch.nn.Module, tokens: list[int] = TOKENS) -> torch.Tensor:
    """Prompt logits and four decode steps'."""
    return paged_logits(model, tokens, len(tokens) - 4, BLOCK)


class GGUFModel:
    """A small GGUF file served with its weights cached in `cache` (as the bundled model
    is), through the loader; `repacks` counts the loads that read the file."""

    def __init__(self, file: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.file, self.cache = file, cache
        self.repacks = 0
        resolved = ResolvedModel(
            path=file.parent, name=file.name, gguf=file, config_from_gguf=True, weight_cache=cache
        )
        monkeypatch.setattr(loader, "resolve_model", lambda *_: resolved)
        real = gguf_file.iter_tensors

        def counted(*args: Any, **kwargs: Any) -> Iterator[Any]:
            self.repacks += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(gguf_file, "iter_tensors", counted)

    def load(self, dtype: str = "float32") -> LoadedModel:
        return load_model(str(self.file), dtype=dtype, device="cpu")

    def entries(self) -> list[Path]:
        return sorted(self.cache.glob(f"*{weight_cache.SUFFIX}"))


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Qwen2 with q/k/v biases and a tied head in Q4_1 (as the bundled model: its 96-wide
    down projection takes the q8 layout), and an untied Llama (rows permuted in the file)
    in Q4_K and Q8_0."""
    folder = tmp_path_factory.mktemp("gguf")
    return {
        "qwen2-tied-bias-q4_1": write_gguf(qwen_reference(2), folder / "qwen2.gguf", Q4_1),
        "llama-untied-q4_k": write_gguf(llama_reference("gqa_untied"), folder / "llama.gguf", Q4_K),
    }


def served(file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GGUFModel:
    """A copy of `file` (the test may touch it) served with its cache in `tmp_path`."""
    copy = tmp_path / file.name
    shutil.copyfile(file, copy)
    return GGUFModel(copy, tmp_path / "cache", monkeypatch)


@pytest.fixture(params=["qwen2-tied-bias-q4_1", "llama-untied-q4_k"])
def gguf_model(
    request: pytest.FixtureRequest,
    gguf_files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> GGUFModel:
    return served(gguf_files[request.param], tmp_path, monkeypatch)


@pytest.fixture
def qwen2_model(
    gguf_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> GGUFModel:
    return served(gguf_files["qwen2-tied-bias-q4_1"], tmp_path, monkeypatch)


def quantized_layers(loaded: LoadedModel) -> list[Linear | Embedding]:
    return [m for m in loaded.model.modules() if isinstance(m, (Linear, Embedding))]


def test_the_first_load_writes_the_entry_and_the_next_maps_it(gguf_model: GGUFModel) -> None:
    with capture_logs() as logs:
        fresh = gguf_model.load()
    assert gguf_model.repacks == 1
    (entry,) = gguf_model.entries()
    assert [(e["event"], e.get("reason")) for e in logs] == [
        ("repacking the weights (cached for the next start)", "no entry")
    ]
    with capture_logs() as logs:
        cached = gguf_model.load()
    assert gguf_model.repacks == 1  # not read from the file again
    assert [(e["event"], e["entry"]) for e in logs] == [
        ("repacked weights mapped from the cache", str(entry))
    ]
    assert logs[0]["seconds"] >= 0
    assert torch.equal(logits_of(cached.model), logits_of(fresh.model))
    for a, b in zip(quantized_layers(fresh), quantized_layers(cached), strict=True):
        assert a.quantized is not None and b.quantized is not None
        wa, wb = a.quantized.weight, b.quantized.weight
        assert (wa.kind, wa.group, wa.source, wa.interleaved, wa.shape) == (
            wb.kind, wb.group, wb.source, wb.interleaved, wb.shape,
        )  # fmt: skip
        assert torch.equal(wa.codes, wb.codes) and torch.equal(wa.scales, wb.scales)
        assert b.quantized.out_features == a.quantized.out_features
    model = cached.model
    if model.tie_word_embeddings:  # one copy of the codes for the table and the head
        assert model.embed_tokens.quantized.weight is model.lm_head.quantized.weight
    # The codes are the entry's bytes, mapped: not a copy in memory.
    codes = model.layers[0].qkv_proj.quantized.weight.codes
    assert codes.data_ptr() % weight_cache.ALIGN == 0
    mapped = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert str(entry) in mapped


@pytest.mark.parametrize("build", ["avx512", "avx2", "torch"])
def test_the_logits_are_a_fresh_repacks_on_every_kernel_build(
    qwen2_model: GGUFModel, build: str
) -> None:
    """Under each build (the native ones interleave the codes they multiply on integers,
    torch reads them all in rows), bf16 as float32, the entry serves the build's logits
    exactly; a build's and a dtype's entry are their own."""
    with use_kernel_build(build):
        for dtype in ("float32", "bfloat16"):
            fresh = qwen2_model.load(dtype)
            cached = qwen2_model.load(dtype)
            assert torch.equal(logits_of(cached.model), logits_of(fresh.model))
            interleaved = {m.quantized.weight.interleaved for m in quantized_layers(cached)}
            assert (True in interleaved) == (build != "torch")
    assert qwen2_model.repacks == 2
    assert [e.name.split("-")[:2] for e in qwen2_model.entries()] == [
        ["bfloat16", build],
        ["float32", build],
    ]


def test_builds_keep_entries_of_their_own(qwen2_model: GGUFModel) -> None:
    """Switching between kernel builds repacks once for each, then maps each's entry."""
    for _ in range(2):
        for build in ("avx2", "torch"):
            with use_kernel_build(build):
                qwen2_model.load()
    assert qwen2_model.repacks == 2 and len(qwen2_model.entries()) == 2


def test_the_entry_is_rebuilt_when_the_file_changes(gguf_model: GGUFModel) -> None:
    gguf_model.load()
    (entry,) = gguf_model.entries()
    before = json.loads(header_bytes(entry))["key"]["source"]
    st = gguf_model.file.stat()
    os.utime(gguf_model.file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    fresh = gguf_model.load()
    assert gguf_model.repacks == 2
    after = json.loads(header_bytes(entry))["key"]["source"]
    assert after["mtime_ns"] == before["mtime_ns"] + 1_000_000_000
    cached = gguf_model.load()
    assert gguf_model.repacks == 2
    assert torch.equal(logits_of(cached.model), logits_of(fresh.model))


def test_an_entry_of_another_build_or_code_is_rebuilt(
    gguf_model: GGUFModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry whose header names another kernel build (or layout code) than this
    process's is repacked over, even under this build's file name."""
    gguf_model.load()
    (entry,) = gguf_model.entries()
    real = weight_cache._build_key
    other = "avx512-0123456789abcdef"
    monkeypatch.setattr(weight_cache, "_build_key", lambda model: {**real(model), "build": other})
    monkeypatch.setattr(weight_cache, "entry_path", lambda model, directory: entry)
    gguf_model.load()
    assert gguf_model.repacks == 2
    assert json.loads(header_bytes(entry))["key"]["build"] == other
    monkeypatch.setattr(weight_cache, "_build_key", real)
    gguf_model.load()
    assert gguf_model.repacks == 3  # and back


def header_bytes(entry: Path) -> bytes:
    data = entry.read_bytes()
    length = int.from_bytes(data[8:16], "little")
    return data[16 : 16 + length]


def damage_header(entry: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the entry's header through `edit`, keeping its length (written compactly,
    padded with spaces)."""
    data = bytearray(entry.read_bytes())
    old = header_bytes(entry)
    header = json.loads(old)
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= len(old)
    data[16 : 16 + len(old)] = new.ljust(len(old))
    entry.write_bytes(bytes(data))


def edit_codes(field: int, change: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    """An edit of the first weight's codes' place in the header: [dtype, shape, offset]."""

    def edit(header: dict[str, Any]) -> None:
        place = header["tensors"][header["weights"][0]["codes"]]
        place[field] = change(place[field])

    return edit


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": lambda e: e.write_bytes(e.read_bytes()[:-100]),
    "cut in its header": lambda e: e.write_bytes(e.read_bytes()[:40]),
    "empty": lambda e: e.write_bytes(b""),
    "extended": lambda e: e.write_bytes(e.read_bytes() + b"\0" * 64),
    "not an entry": lambda e: e.write_bytes(b"PK\x03\x04" + e.read_bytes()[4:]),
    "garbled header": lambda e: e.write_bytes(e.read_bytes()[:20] + b"\xff{" + e.read_bytes()[22:]),
    "a tensor's shape": lambda e: damage_header(
        e, edit_codes(1, lambda shape: [shape[0] // 2, shape[1] * 2])
    ),
    "a tensor past the end": lambda e: damage_header(e, edit_codes(2, lambda _: 2**40)),
    "a misaligned tensor": lambda e: damage_header(e, edit_codes(2, lambda at: at + 1)),
    "a weight's format": lambda e: damage_header(
        e, lambda h: h["weights"][0].__setitem__("kind", "q2")
    ),
    "a layer missing": lambda e: damage_header(e, lambda h: h["layers"].popitem()),
    "a parameter's dtype": lambda e: damage_header(
        e,
        lambda h: h["tensors"][next(iter(h["parameters"].values()))].__setitem__(0, "float16"),
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_rebuilt_not_trusted(
    qwen2_model: GGUFModel, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_model = qwen2_model
    fresh = gguf_model.load()
    (entry,) = gguf_model.entries()
    DAMAGE[damage](entry)
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(weight_cache, "_log", Recorder(events))
    rebuilt = gguf_model.load()
    assert gguf_model.repacks == 2
    assert next(e["reason"] for e in events if "reason" in e).startswith("a damaged entry")
    assert torch.equal(logits_of(rebuilt.model), logits_of(fresh.model))
    cached = gguf_model.load()  # the entry written again serves
    assert gguf_model.repacks == 2
    assert torch.equal(logits_of(cached.model), logits_of(fresh.model))


class Recorder:
    """A stand-in for the module's logger that keeps what it is told."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events

    def _record(self, event: str, **fields: Any) -> None:
        self.events.append({"event": event, **fields})

    info = warning = _record


def test_an_entry_is_written_whole_or_not_at_all(
    gguf_model: GGUFModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While an entry is written, its name shows the old entry or none; a write that fails
    midway leaves neither the part written nor its temporary file, and the load goes on."""
    real_write = weight_cache._write
    seen: list[tuple[bool, bytes | None]] = []

    def watched(f: Any, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        entries = gguf_model.entries()
        seen.append((bool(entries), entries[0].read_bytes() if entries else None))
        real_write(f, header, tensors)
        f.flush()
        seen.append((bool(gguf_model.entries()), None))

    monkeypatch.setattr(weight_cache, "_write", watched)
    gguf_model.load()
    assert seen == [(False, None), (False, None)]  # nothing under the name until renamed
    (entry,) = gguf_model.entries()
    old = entry.read_bytes()
    st = gguf_model.file.stat()
    os.utime(gguf_model.file, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # stale: rewritten
    seen.clear()
    gguf_model.load()
    assert seen[0] == (True, old) and entry.read_bytes() != old

    def failing(f: Any, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        f.write(b"FLOWLLMW" + b"\0" * 1000)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weight_cache, "_write", failing)
    entry.unlink()
    loaded = gguf_model.load()
    assert gguf_model.entries() == []
    assert list(gguf_model.cache.iterdir()) == []  # no temporary file left behind
    assert all(m.quantized is not None for m in quantized_layers(loaded))


def test_a_cache_that_cannot_be_written_only_costs_the_repack(
    gguf_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache's directory would be")
    model = GGUFModel(gguf_files["qwen2-tied-bias-q4_1"], blocked / "cache", monkeypatch)
    first, second = model.load(), model.load()
    assert model.repacks == 2
    assert torch.equal(logits_of(first.model), logits_of(second.model))


def test_leftover_temporary_files_are_removed(qwen2_model: GGUFModel) -> None:
    gguf_model = qwen2_model
    gguf_model.cache.mkdir(parents=True)
    old = gguf_model.cache / f".bfloat16-avx512-0123{weight_cache.SUFFIX}.abc.tmp"
    recent = gguf_model.cache / f".bfloat16-avx512-4567{weight_cache.SUFFIX}.def.tmp"
    for f in (old, recent):
        f.write_bytes(b"part of an entry")
    os.utime(old, (1, 1))
    gguf_model.load()
    assert not old.exists() and recent.exists()


def test_the_bundled_model_caches_its_weights_beside_the_converted_directory(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Served by name, the bundled model's entry lives in its converted directory; the
    second load maps it, and its logits equal the first's (a fresh repack of the file)
    exactly. The converted directory is a copy here, its weights linked."""
    monkeypatch.setenv("FLOWLLM_CACHE", str(tmp_path))
    converted = bundled_model_dir()
    converted.mkdir(parents=True)
    for f in smollm2_dir.iterdir():
        if f.suffix == ".safetensors":
            (converted / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy2(f, converted / f.name)
    assert (converted / SOURCE_FILE).is_file()
    repacks: list[int] = []
    real = quant_linear.from_gguf
    monkeypatch.setattr(
        gguf_file,
        "from_gguf",
        lambda *a: repacks.append(1) or real(*a),  # type: ignore[func-returns-value]
    )
    fresh = load_model(BUNDLED_MODEL, device="cpu")
    assert repacks and [e.parent for e in (converted / REPACKED_DIR).iterdir()] == [
        converted / REPACKED_DIR
    ]
    repacks.clear()
    cached = load_model(BUNDLED_MODEL, device="cpu")
    assert repacks == []
    model = cached.model
    assert model.embed_tokens.quantized.weight is model.lm_head.quantized.weight
    tokens = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 314, 28, 7018]
    assert torch.equal(logits_of(model, tokens), logits_of(fresh.model, tokens))


def test_a_directory_keeps_its_most_recently_used_entries(
    qwen2_model: GGUFModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing an entry removes those beyond the KEEP most recently used: an old entry
    that served lately stays, the least recently used goes."""
    real = weight_cache._build_key
    entry_of = {}

    def load(version: int) -> None:
        code = f"{version:016x}"
        monkeypatch.setattr(weight_cache, "_build_key", lambda model: {**real(model), "code": code})
        qwen2_model.load()
        entry_of[version] = max(qwen2_model.entries(), key=lambda e: e.stat().st_mtime_ns)

    load(0)
    os.utime(entry_of[0], (1, 1))  # the oldest by far...
    for version in range(1, weight_cache.KEEP):
        load(version)
    load(0)  # ...serves again
    load(weight_cache.KEEP)  # one entry too many
    assert qwen2_model.repacks == weight_cache.KEEP + 1
    assert sorted(qwen2_model.entries()) == sorted(
        entry_of[v] for v in (0, *range(2, weight_cache.KEEP + 1))
    )
