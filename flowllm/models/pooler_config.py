"""What a checkpoint is served for (`--task`), and how its pooler turns the last hidden
states of a prompt into its vector: read from config.json and the sentence-transformers
files (modules.json, the Pooling module's config.json, sentence_bert_config.json) without
torch, so that the supervisor picks the graph and the fronts check requests with it.

Tasks, as vLLM names them: `generate` (the default graph), `embed` (a vector per input:
`BertModel` encoders, and decoders served as embedders, the Qwen3-Embedding layout) and
`score` (a cross-encoder, `BertForSequenceClassification` with one label, scores a pair).
`auto` reads the checkpoint: a sequence classifier scores, a `BertModel` embeds, a decoder
with sentence-transformers files embeds, any other decoder generates.

Without sentence-transformers files the pooler is vLLM's default for the architecture: a
BERT encoder's [CLS] row, a decoder's last row, L2-normalized. Sentence-transformers
modules other than Transformer, Pooling and Normalize, and pooling modes other than cls,
mean and lasttoken, are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from flowllm.models.checkpoint_json import read_json
from flowllm.models.load_errors import CorruptCheckpointError, ModelLoadError

Task = Literal["generate", "embed", "score"]
PoolingType = Literal["cls", "mean", "last"]
Activation = Literal["sigmoid", "identity"]

ENCODERS = ("BertModel", "BertForSequenceClassification")
CROSS_ENCODERS = ("BertForSequenceClassification",)
_MODULES = ("Transformer", "Pooling", "Normalize")  # sentence-transformers' classes served
# sentence-transformers' pooling modes (legacy config keys and current names) -> ours
_POOLING_MODES: dict[str, PoolingType] = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ACTIVATIONS: dict[str, Activation] = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.Identity": "identity",
}


class UnsupportedTaskError(ModelLoadError):
    """The checkpoint cannot serve the task asked for, or its pooler is one flowllm lacks."""


class PoolerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How a pooling model's vectors are made (the pool stage's) and what a request may
    ask of them (the validate stage's)."""

    task: Literal["embed", "score"]
    pooling: PoolingType  # which rows make the vector: the first, all (mean), the last
    normalize: bool  # embed: L2-normalized unless a request says otherwise
    size: int  # the vector's length: the hidden size (embed), 1 (score)
    # Matryoshka embeddings: any `dimensions` up to `size` (True), or only those listed.
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    activation: Activation = "identity"  # score: applied to the classifier's output
    max_seq_length: int | None = None  # sentence-transformers' truncation length

    @property
    def whole_prompts(self) -> bool:
        """Whether each prompt must run in one step: an encoder sees it whole, and a mean
        reads every row; only a decoder's last row may come at the end of chunks."""
        return self.pooling != "last"


def checkpoint_config(path: Path) -> dict[str, Any]:
    """config.json of a model directory as a dict ({} when there is none)."""
    file = path / "config.json"
    if not file.is_file():
        return {}
    config = read_json(file, "model config")
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"model config {file} is not an object")
    return config


def num_labels(config: Any) -> int:
    """A classifier's outputs as transformers counts them: `num_labels`, else the entries
    of `id2label`, else 2 (`config`: a dict, or a config object)."""

    def get(name: str) -> Any:
        return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)

    return int(get("num_labels") or len(get("id2label") or {}) or 2)


def _architectures(config: dict[str, Any]) -> list[str]:
    return [str(a) for a in config.get("architectures") or ()]


def is_encoder(config: dict[str, Any]) -> bool:
    """A BERT-family encoder checkpoint (bidirectional attention, no paged cache)."""
    archs = _architectures(config)
    return any(a in ENCODERS for a in archs) or (not archs and config.get("model_type") == "bert")


def resolve_task(path: Path, requested: str, *, from_gguf: bool = False) -> Task:
    """The task to serve the model directory `path` for: `requested`, checked against
    what the checkpoint can do, or, for `auto`, what it is for."""
    if from_gguf:
        if requested in ("auto", "generate"):
            return "generate"
        raise UnsupportedTaskError(
            f"--task {requested} needs a safetensors checkpoint; a GGUF file generates"
        )
    config = checkpoint_config(path)
    archs = _architectures(config)
    cross_encoder = any(a in CROSS_ENCODERS for a in archs)
    encoder = is_encoder(config)
    natural: Task
    if cross_encoder:
        natural = "score"
    elif encoder or (path / "modules.json").is_file():
        natural = "embed"
    else:
        natural = "generate"
    if requested == "auto" or requested == natural:
        return natural
    shown = ", ".join(archs) or str(config.get("model_type"))
    if requested == "generate" and encoder:
        raise UnsupportedTaskError(f"{shown} is an encoder: it serves embed or score, not generate")
    if requested == "embed" and cross_encoder:
        raise UnsupportedTaskError(
            f"{shown} is a cross-encoder: it scores pairs (--task score), it does not embed"
        )
    if requested == "score":
        raise UnsupportedTaskError(
            f"--task score needs a cross-encoder (BertForSequenceClassification), not {shown}; "
            "an embedding model (--task embed) serves /v1/score and /v1/rerank by cosine "
            "similarity"
        )
    if requested not in ("generate", "embed"):
        raise UnsupportedTaskError(f"unknown task {requested!r}")
    return "embed" if requested == "embed" else "generate"


def _module_type(entry: dict[str, Any]) -> str:
    """A modules.json entry's class name (`sentence_transformers.models.Pooling` and its
    newer paths alike)."""
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def _pooling_mode(config: dict[str, Any], where: Path) -> PoolingType:
    mode = config.get("pooling_mode")
    modes: list[str]
    if mode is None:
        modes = [name for key, name in _LEGACY_MODE_KEYS.items() if config.get(key)]
    else:
        modes = [mode] if isinstance(mode, str) else [str(m) for m in mode]
    if len(modes) != 1 or modes[0] not in _POOLING_MODES:
        raise UnsupportedTaskError(
            f"pooling mode {' + '.join(modes) or 'none'} ({where}) is not supported; flowllm "
            "pools with one of cls, mean, lasttoken"
        )
    return _POOLING_MODES[modes[0]]


def _sentence_transformers(path: Path) -> tuple[PoolingType | None, bool]:
    """(pooling mode, Normalize module present) from modules.json; (None, False) without
    one."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None, False
    modules = read_json(modules_file, "sentence-transformers modules")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise CorruptCheckpointError(f"{modules_file} is not a list of modules")
    for entry in modules:
        if _module_type(entry) not in _MODULES:
            raise UnsupportedTaskError(
                f"sentence-transformers module {entry.get('type')!r} ({modules_file}) is not "
                f"supported; flowllm runs {', '.join(_MODULES)}"
            )
    pooling: PoolingType | None = None
    for entry in modules:
        if _module_type(entry) == "Pooling":
            where = path / str(entry.get("path", "")) / "config.json"
            pooling_config = read_json(where, "pooling config")
            if not isinstance(pooling_config, dict):
                raise CorruptCheckpointError(f"{where} is not an object")
            pooling = _pooling_mode(pooling_config, where)
    return pooling, any(_module_type(entry) == "Normalize" for entry in modules)


def _max_seq_length(path: Path) -> int | None:
    file = path / "sentence_bert_config.json"
    if not file.is_file():
        return None
    value = read_json(file, "sentence-transformers config")
    length = value.get("max_seq_length") if isinstance(value, dict) else None
    return int(length) if isinstance(length, int) and length > 0 else None


def _activation(config: dict[str, Any]) -> Activation:
    """A cross-encoder's activation as sentence-transformers' CrossEncoder reads it:
    `sentence_transformers.activation_fn`, the older `sbert_ce_default_activation_function`,
    else sigmoid (one label)."""
    st = config.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or config.get("sbert_ce_default_activation_function")
    if name is None:
        return "sigmoid"
    if name not in _ACTIVATIONS:
        raise UnsupportedTaskError(
            f"cross-encoder activation {name!r} is not supported; flowllm applies "
            f"{', '.join(sorted(set(_ACTIVATIONS.values())))}"
        )
    return _ACTIVATIONS[name]


def read_pooler_config(path: Path, task: Task) -> PoolerConfig | None:
    """The pooler of the model directory `path` served for `task` (None: generate)."""
    if task == "generate":
        return None
    config = checkpoint_config(path)
    encoder = is_encoder(config)
    max_seq_length = _max_seq_length(path)
    if task == "score":
        labels = num_labels(config)
        if labels != 1:
            raise UnsupportedTaskError(
                f"a cross-encoder with {labels} labels cannot score pairs; flowllm scores "
                "with one label (a relevance logit)"
            )
        return PoolerConfig(
            task="score",
            pooling="cls",
            normalize=False,
            size=1,
            activation=_activation(config),
            max_seq_length=max_seq_length,
        )
    pooling, normalize = _sentence_transformers(path)
    if pooling is None:  # vLLM's defaults
        pooling, normalize = ("cls" if encoder else "last"), True
    size = int(config.get("hidden_size") or 0)
    dims = config.get("matryoshka_dimensions") or ()
    return PoolerConfig(
        task="embed",
        pooling=pooling,
        normalize=normalize,
        size=size,
        matryoshka=bool(config.get("is_matryoshka")) or bool(dims),
        matryoshka_dimensions=tuple(sorted(int(d) for d in dims)),
        max_seq_length=max_seq_length,
    )
