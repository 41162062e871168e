"""Find a model's HF-format directory and load its weights into one of flowllm's model classes.

A model name resolves, in order, to:
  1. the bundled `smollm2-135m-instruct`: its Q4_1 GGUF file's quantized weights, with
     the config and tokenizer of the HF-format directory converted once from that file
     (bundled.py); with quantization `none`, that directory's dequantized weights;
  2. a GGUF file (`*.gguf`): weights, config and tokenizer from the file (gguf_file.py);
  3. a local directory (an existing path, or anything spelled like a path);
  4. a Hugging Face Hub id, fetched with `huggingface_hub.snapshot_download` (only config,
     safetensors, tokenizer and generation files). `gpt2` means `openai-community/gpt2`.

Hub settings are read from the environment at call time, not at import time (as
huggingface_hub does), so `HF_HOME`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE`, `HF_TOKEN` and
`HF_ENDPOINT` take effect whenever they are set.

Every failure is a `ModelLoadError` (load_errors.py) whose str() is one line naming the
model and what to do; the CLI prints it without a traceback.

torch is imported where tensors are made: resolving a name needs none, so the process
that supervises `flowllm serve` resolves (and converts) the model without importing it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from flowllm.config import BUNDLED_MODEL, QUANTIZATIONS
from flowllm.models.checkpoint_json import read_json
from flowllm.models.load_errors import (
    BundledModelLoadError,
    CorruptCheckpointError,
    HubUnreachableError,
    MissingFileError,
    ModelLoadError,
    ModelNotFoundError,
    UnknownArchitectureError,
    WeightMismatchError,
    one_line,
)

if TYPE_CHECKING:
    import torch

    from flowllm.models.bert import BertModel
    from flowllm.models.causal_lm import PagedCausalLM
    from flowllm.models.pooler_config import PoolerConfig, Task

# Old unprefixed Hub names that now live under an organisation.
HUB_ALIASES = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
}

# What a snapshot download fetches: enough to serve, never pickled or duplicate weights
# (`model*.safetensors` is the HF-format file or its shards, not e.g. a consolidated.* copy).
HUB_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
]
# Sub-folders (onnx/, original/, ...) hold other formats of the same weights.
HUB_IGNORE_PATTERNS = ["*/*"]

GGUF_SUFFIX = ".gguf"
SAFETENSORS_FILE = "model.safetensors"
REPACKED_DIR = "repacked"  # in a converted directory: its GGUF file's weights, repacked
SAFETENSORS_INDEX = "model.safetensors.index.json"
_BUNDLED_HINT = f"try the bundled model: flowllm serve {BUNDLED_MODEL}"


# ----------------------------------------------------------------------------------------
# Resolution


@dataclass(frozen=True)
class ResolvedModel:
    """An HF-format model directory (for a GGUF file: its folder) and the name it was asked
    for; `gguf` is the file the weights come from, if one."""

    path: Path
    name: str
    gguf: Path | None = None
    config_from_gguf: bool = False  # config and tokenizer from the file's metadata
    # where the file's weights, repacked, are cached (flowllm/models/weight_cache.py)
    weight_cache: Path | None = None


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """Whether Hub access is switched off (`HF_HUB_OFFLINE` or `TRANSFORMERS_OFFLINE`)."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def hub_cache_dir() -> Path:
    """The HF hub cache, resolved as huggingface_hub does but from the current environment."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(os.path.expandvars(home)).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def _looks_like_path(name: str) -> bool:
    """A name the user meant as a path: Hub ids are `name` or `org/name`, never more."""
    return (
        name.startswith(("/", "./", "../", "~", "."))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def is_gguf(path: Path) -> bool:
    """Whether `path` names a GGUF file."""
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


def resolve_model(name: str, quantization: str = "auto") -> ResolvedModel:
    """Resolve a model name to an HF-format directory or a GGUF file (see the module
    docstring for the order)."""
    if not name or not name.strip():
        raise ModelNotFoundError("no model name given")
    if name == BUNDLED_MODEL:
        return _bundled(quantization)
    path = Path(name).expanduser()
    if path.exists() or _looks_like_path(name):
        if not path.exists():
            raise ModelNotFoundError(f"model {name!r} does not exist")
        if is_gguf(path):
            file = path.resolve()
            return ResolvedModel(path=file.parent, name=name, gguf=file, config_from_gguf=True)
        if not path.is_dir():
            raise ModelNotFoundError(
                f"model {name!r} is a file but not a GGUF file (*.gguf); give a GGUF file "
                "or a model directory"
            )
        return ResolvedModel(path=path.resolve(), name=name)
    return ResolvedModel(path=_hub_snapshot(name), name=name)


def _bundled(quantization: str) -> ResolvedModel:
    """The bundled model: the converted directory's config and tokenizer (nothing rebuilt
    from the file's metadata) and, unless asked to dequantize, the file's quantized
    weights."""
    from flowllm.models.bundled import BundledModelError, bundled_gguf_path, ensure_bundled_model

    try:
        path = ensure_bundled_model()
        gguf = bundled_gguf_path() if quantization == "auto" else None
    except BundledModelError as e:
        raise BundledModelLoadError(str(e)) from e
    cache = None if gguf is None else path / REPACKED_DIR
    return ResolvedModel(path=path, name=BUNDLED_MODEL, gguf=gguf, weight_cache=cache)


def _hub_snapshot(name: str) -> Path:
    """Download (or find in the cache) a Hub repository's serving files."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id = HUB_ALIASES.get(name, name)
    shown = repr(name) if repo_id == name else f"{name!r} ({repo_id})"
    cache = hub_cache_dir()
    offline = hub_offline()
    try:
        path = snapshot_download(
            repo_id,
            cache_dir=cache,
            allow_patterns=HUB_ALLOW_PATTERNS,
            ignore_patterns=HUB_IGNORE_PATTERNS,
            local_files_only=offline,
            token=os.environ.get("HF_TOKEN") or None,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
        )
    except HFValidationError as e:
        raise ModelNotFoundError(
            f"model {shown} is neither a local directory nor a valid Hugging Face Hub id (org/name)"
        ) from e
    except IncompleteSnapshotError as e:
        raise HubUnreachableError(
            f"model {shown} is only partly in the HF cache at {cache} and the Hugging Face "
            f"Hub cannot be reached to complete it; {_BUNDLED_HINT}"
        ) from e
    except LocalEntryNotFoundError as e:
        why = "offline mode is on (HF_HUB_OFFLINE)" if offline else "the Hub cannot be reached"
        raise HubUnreachableError(
            f"model {shown} is not in the HF cache at {cache} and {why}; {_BUNDLED_HINT}"
        ) from e
    except GatedRepoError as e:
        raise ModelNotFoundError(
            f"model {shown} is gated on the Hugging Face Hub: accept its terms and set HF_TOKEN"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(f"model {shown} has no 'main' revision on the Hub") from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(
            f"model {shown} is neither a local directory nor a Hugging Face Hub repository "
            "(if it is private, set HF_TOKEN)"
        ) from e
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        raise HubUnreachableError(
            f"model {shown}: the Hugging Face Hub answered HTTP {status}; {_BUNDLED_HINT}"
        ) from e
    except (OSError, ValueError) as e:
        # Proxy errors, unwritable caches, bad arguments: huggingface_hub's own message.
        raise ModelLoadError(f"model {shown}: {one_line(e)}") from e
    except Exception as e:
        # Network stack errors (httpx) that huggingface_hub does not wrap.
        if type(e).__module__.startswith(("httpx", "httpcore", "requests", "urllib3")):
            raise HubUnreachableError(
                f"model {shown}: cannot reach the Hugging Face Hub ({type(e).__name__}); "
                f"{_BUNDLED_HINT}"
            ) from e
        raise
    return Path(path)


# ----------------------------------------------------------------------------------------
# Tensors


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a model directory, in load order.

    A sharded checkpoint is described by `model.safetensors.index.json` (its `weight_map`
    names a shard per tensor); otherwise `model.safetensors`, or failing that every
    top-level `*.safetensors` file.
    """
    path = Path(path)
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        data = read_json(index, "safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CorruptCheckpointError(f"safetensors index {index} has no weight_map")
        shards = list(dict.fromkeys(str(s) for s in weight_map.values()))  # first-seen order
        files = [path / s for s in shards]
        for f in files:
            if not f.is_file():
                raise MissingFileError(f"checkpoint shard {f.name} (listed in {index}) is missing")
        return files
    single = path / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    others = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.gguf")]
    hint = f" (found {', '.join(sorted(others))}: only safetensors are loaded)" if others else ""
    raise MissingFileError(f"no safetensors weights in {path}{hint}")


def iter_weights(
    path: Path | str, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, CPU tensor) for every tensor of a model directory.

    Files are memory-mapped by safetensors, so only one tensor at a time is materialised;
    floating-point tensors are cast to `dtype` as they are read (integer tensors keep theirs).
    """
    from safetensors import SafetensorError, safe_open

    for file in safetensors_files(Path(path)):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    t = f.get_tensor(name)
                    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                        t = t.to(dtype)
                    yield name, t
        except SafetensorError as e:
            raise CorruptCheckpointError(f"corrupt safetensors file {file}: {e}") from e
        except OSError as e:
            raise CorruptCheckpointError(f"cannot read safetensors file {file}: {e}") from e


# ----------------------------------------------------------------------------------------
# Configs and the model


class ModelConfig(SimpleNamespace):
    """A checkpoint's config.json, its fields as attributes (as a transformers config).

    flowllm's model classes read each field with its transformers default
    (flowllm.models.layers.config_get), so the file is not handed to transformers, whose
    model config classes import most of its modelling code (about a second of a start).
    """

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def load_hf_config(path: Path | str) -> ModelConfig:
    """The directory's config.json, with a clear error for an architecture flowllm does not
    run."""
    from flowllm.models.registry import ARCHITECTURES, MODEL_TYPES

    path = Path(path)
    raw = read_json(path / "config.json", "model config")
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"model config {path / 'config.json'} is not an object")
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if not model_type:
        raise UnknownArchitectureError(
            f"model config {path / 'config.json'} has no model_type (architectures: {archs})"
        )
    if model_type not in MODEL_TYPES and not any(arch in ARCHITECTURES for arch in archs):
        raise UnknownArchitectureError(
            f"unknown model architecture {model_type!r} ({', '.join(archs) or 'no architectures'})"
            f" in {path}; flowllm runs {', '.join(ARCHITECTURES)}"
        )
    return ModelConfig(**{str(key): value for key, value in raw.items()})


def load_generation_config(path: Path | str) -> dict[str, Any]:
    """generation_config.json as a plain dict (empty when the model has none)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    data = read_json(file, "generation config")
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"generation config {file} is not an object")
    return data


def resolve_device(device: torch.device | str = "auto") -> torch.device:
    """`auto` is CUDA when available, else CPU."""
    import torch

    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ModelLoadError(f"invalid device {device!r}: {one_line(e)}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(
    dtype: torch.dtype | str, hf_config: Any, device: torch.device | str = "cpu"
) -> torch.dtype:
    """A torch dtype as given, or a name (`auto`, `float32`, `bfloat16`, `float16`) resolved
    by flowllm.models.dtype's policy for this device and checkpoint."""
    import torch

    from flowllm.config import ConfigError
    from flowllm.models import dtype as dtype_policy

    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return dtype_policy.resolve_dtype(dtype, device, hf_config)
    except ConfigError as e:
        raise ModelLoadError(one_line(e)) from e


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it."""

    model: PagedCausalLM | BertModel
    hf_config: ModelConfig  # config.json
    path: Path
    dtype: torch.dtype
    device: torch.device
    generation_config: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    # the GGUF file whose metadata holds the tokenizer (None: the directory's files)
    tokenizer_gguf: Path | None = None
    task: Task = "generate"
    pooler: PoolerConfig | None = None  # a model served for pooling: its pooler


def load_model(
    name_or_path: str,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "auto",
    quantization: str = "auto",
    task: str = "generate",
) -> LoadedModel:
    """Resolve `name_or_path`, build its flowllm model class and load the weights into it.

    quantization: `auto` keeps a GGUF file's quantized weights (the bundled model's too)
    quantized on the CPU and loads others as stored; `none` dequantizes them at load (the
    bundled model then loads from its converted directory, as an HF model); `int8`
    quantizes a float checkpoint's linear layers (but the LM head) to int8 per output
    channel. task: `generate`, `embed`, `score` or `auto` (flowllm.models.pooler_config);
    a decoder served for pooling loads without its LM head."""
    from flowllm.models import gguf_file, weight_cache
    from flowllm.models.causal_lm import PagedCausalLM
    from flowllm.models.errors import ModelError, UnsupportedModelError, WeightLoadError
    from flowllm.models.pooler_config import read_pooler_config, resolve_task
    from flowllm.models.registry import model_class_for

    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    resolved = resolve_model(name_or_path, quantization)
    dev = resolve_device(device)
    if resolved.gguf is not None and quantization == "int8":
        raise ModelLoadError(
            f"model {name_or_path!r} is a GGUF file, quantized already: --quantization int8 "
            "applies to float (safetensors) checkpoints"
        )

    @functools.cache
    def reader() -> Any:
        """The GGUF file's reader, opened when first needed: it parses all the metadata
        (seconds for a large vocabulary), which weights from the cache do not need."""
        assert resolved.gguf is not None
        opened = gguf_file.open_reader(resolved.gguf)
        gguf_file.architecture(opened)
        return opened

    try:
        hf_config = (
            gguf_file.load_config(resolved.gguf, reader())
            if resolved.config_from_gguf and resolved.gguf is not None
            else load_hf_config(resolved.path)
        )
    except gguf_file.GGUFError as e:
        raise UnknownArchitectureError(f"model {name_or_path!r}: {one_line(e)}") from e
    generation_config = {} if resolved.config_from_gguf else load_generation_config(resolved.path)
    quantized = quantization == "int8" or (
        resolved.gguf is not None and quantization == "auto" and dev.type == "cpu"
    )
    torch_dtype = resolve_dtype(dtype, hf_config, dev)
    try:
        cls = model_class_for(hf_config)
    except UnsupportedModelError as e:
        raise UnknownArchitectureError(f"model {name_or_path!r}: {one_line(e)}") from e
    served = resolve_task(resolved.path, task, from_gguf=resolved.config_from_gguf)
    pooler = read_pooler_config(resolved.path, served)
    headless = served != "generate" and issubclass(cls, PagedCausalLM)
    if headless:
        # The LM head is never run: its tensor, if any, is skipped, and the head is built
        # tied to the embedding (the checkpoint may have none), then dropped.
        hf_config = ModelConfig(**{**hf_config.to_dict(), "tie_word_embeddings": True})
    if resolved.gguf is None:
        safetensors_files(resolved.path)  # fail on missing weights before building the model
    where = "" if Path(name_or_path) == resolved.path else f" ({resolved.gguf or resolved.path})"
    try:
        model = cls(hf_config, torch_dtype, dev)
        model.quantization = "int8" if quantization == "int8" else None
        if resolved.gguf is not None:
            assert isinstance(model, PagedCausalLM)  # a GGUF file holds a decoder

            def from_file() -> None:
                weights = gguf_file.iter_tensors(reader(), hf_config, dequantize=not quantized)
                model.load_weights(_cast(weights, torch_dtype))

            if quantized and resolved.weight_cache is not None:
                weight_cache.load(model, resolved.gguf, resolved.weight_cache, from_file)
            else:
                from_file()
        else:
            weights = iter_weights(resolved.path, torch_dtype)
            model.load_weights(_without_lm_head(weights) if headless else weights)
        if isinstance(model, PagedCausalLM) and headless:
            model.drop_lm_head()
    except gguf_file.GGUFError as e:
        raise CorruptCheckpointError(f"model {name_or_path!r}{where}: {one_line(e)}") from e
    except WeightLoadError as e:
        raise WeightMismatchError(f"model {name_or_path!r}{where}: {one_line(e)}") from e
    except UnsupportedModelError as e:
        raise UnknownArchitectureError(f"model {name_or_path!r}: {one_line(e)}") from e
    except ModelError as e:
        raise ModelLoadError(f"model {name_or_path!r}: {one_line(e)}") from e
    model.eval()
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        path=resolved.path,
        generation_config=generation_config,
        name=resolved.name,
        dtype=torch_dtype,
        device=dev,
        tokenizer_gguf=resolved.gguf if resolved.config_from_gguf else None,
        task=served,
        pooler=pooler,
    )


def _without_lm_head(
    weights: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors but its LM head's."""
    return ((name, w) for name, w in weights if name.removeprefix("model.") != "lm_head.weight")


def _cast(weights: Iterator[tuple[str, Any]], dtype: torch.dtype) -> Iterator[tuple[str, Any]]:
    """Float tensors cast to `dtype` (quantized ones pass as they are)."""
    import torch

    for name, w in weights:
        if isinstance(w, torch.Tensor) and w.is_floating_point() and w.dtype != dtype:
            w = w.to(dtype)
        yield name, w
