"""The draft model of speculative decoding (method draft_model): a smaller checkpoint that
shares the target's tokenizer, loaded by flowllm's own loader on the target's device, with
a paged KV cache of its own.

A draft whose tokens would mean other text than the target's is refused before anything
runs: its vocabulary size must be the target's (what vLLM checks), and where both
directories hold their tokenizer's vocabulary as JSON (tokenizer.json, vocab.json) the two
must be equal. `check_draft` reads only files, without torch, so the process that
supervises `flowllm serve` refuses a bad draft in one line before it starts the engine;
`load_draft` checks again against the loaded models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from flowllm.config import ConfigError, EngineConfig, SpeculativeConfig
from flowllm.models.load_errors import ModelLoadError, one_line
from flowllm.models.loader import resolve_model
from flowllm.models.tokenizer import tokenizer_source

if TYPE_CHECKING:
    import torch

    from flowllm.models.causal_lm import PagedCausalLM
    from flowllm.models.kv_cache import KVCaches

_FIELD = "speculative_config"


@dataclass
class DraftModel:
    """A loaded draft model and its KV cache, shared by every run of the graph (each run's
    propose stage keeps its own block tables, flowllm.models.draft_proposer)."""

    model: PagedCausalLM
    kv_caches: KVCaches
    num_blocks: int
    block_size: int
    # positions the draft computes: its own context, at most the target's max_model_len
    max_len: int
    device: torch.device


def drafts_with_model(config: EngineConfig) -> bool:
    """Whether `config` speculates with a draft model."""
    return config.speculative is not None and config.speculative.method == "draft_model"


def _draft_name(config: SpeculativeConfig, field: str = _FIELD) -> str:
    if config.model is None:
        raise ConfigError(f"{field}: model must name the draft model for method 'draft_model'")
    return config.model


def _tokenizer_vocab(path: Path) -> Any:
    """The tokenizer's vocabulary as its files hold it (the model's vocabulary and the
    added tokens of tokenizer.json, or vocab.json); None when neither is there."""
    file = path / "tokenizer.json"
    try:
        if file.is_file():
            data = json.loads(file.read_text(encoding="utf-8"))
            added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens", ()))
            return data.get("model", {}).get("vocab"), added
        file = path / "vocab.json"
        if file.is_file():
            return json.loads(file.read_text(encoding="utf-8")), []
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return None


def _config_vocab_size(path: Path) -> int | None:
    try:
        size = json.loads((path / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) else None


def _vocab_error(name: str, draft: int, target: int, field: str = _FIELD) -> ConfigError:
    return ConfigError(
        f"{field}: model {name!r} has a vocabulary of {draft} tokens, the target's has "
        f"{target}: a draft model must share the target's tokenizer"
    )


def check_draft(config: EngineConfig, field: str = _FIELD) -> None:
    """Refuse, before anything loads, a draft model (of `config.speculative`) that does not
    resolve or whose files give it another vocabulary than the target's: ConfigError
    naming `field` (the setting, or the CLI flag). Reads files only."""
    if config.speculative is None or not drafts_with_model(config):
        return
    name = _draft_name(config.speculative, field)
    try:
        resolved = resolve_model(name)
        target_dir, _, target_gguf = tokenizer_source(config)
    except ModelLoadError as e:
        raise ConfigError(f"{field}: model: {one_line(e)}") from None
    if resolved.config_from_gguf or target_gguf is not None:
        return  # a GGUF file's vocabulary is in its metadata: checked at load
    draft_size, target_size = _config_vocab_size(resolved.path), _config_vocab_size(target_dir)
    if draft_size is not None and target_size is not None and draft_size != target_size:
        raise _vocab_error(name, draft_size, target_size, field)
    draft_vocab, target_vocab = _tokenizer_vocab(resolved.path), _tokenizer_vocab(target_dir)
    if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
        raise ConfigError(
            f"{field}: model {name!r} has another tokenizer vocabulary than the target's: "
            "a draft model must share the target's tokenizer"
        )


def load_draft(
    config: SpeculativeConfig,
    target: PagedCausalLM,
    max_model_len: int,
    block_size: int,
) -> DraftModel:
    """Load the draft model of `config` beside `target` (its device, and its dtype unless
    `config.dtype` names one; quantized as `config.quantization` says) and allocate its KV
    cache of `config.draft_kv_cache_memory` bytes. ConfigError, naming the field, for a
    draft that does not load, whose vocabulary size differs from the target's, or whose
    cache holds no block."""
    from flowllm.models.causal_lm import PagedCausalLM
    from flowllm.models.errors import KVCacheError
    from flowllm.models.kv_cache import KVCacheSpec
    from flowllm.models.layers import quantized_formats
    from flowllm.models.loader import load_model

    name = _draft_name(config)
    dtype = target.dtype if config.dtype is None else config.dtype
    try:
        loaded = load_model(name, dtype, target.device, config.quantization)
    except ModelLoadError as e:
        raise ConfigError(f"{_FIELD}: model: {one_line(e)}") from None
    model = loaded.model
    if not isinstance(model, PagedCausalLM):
        raise ConfigError(f"{_FIELD}: model {name!r} is not a causal language model")
    if model.vocab_size != target.vocab_size:
        raise _vocab_error(name, model.vocab_size, target.vocab_size)
    max_len = min(model.max_position_embeddings, max_model_len)
    model.limit_context(max_len)
    spec = KVCacheSpec.for_model(model, block_size)
    try:
        num_blocks = spec.num_blocks_for(config.draft_kv_cache_memory, "draft_kv_cache_memory")
        kv_caches = spec.allocate(num_blocks, loaded.device)
    except KVCacheError as e:
        raise ConfigError(f"{_FIELD}: {one_line(e)}") from None
    structlog.get_logger("flowllm.models").info(
        "draft model",
        model=name,
        layers=model.num_layers,
        dtype=str(loaded.dtype).removeprefix("torch."),
        quantized=",".join(quantized_formats(model)) or "none",
        kv_blocks=num_blocks,
        max_len=max_len,
    )
    return DraftModel(model, kv_caches, num_blocks, block_size, max_len, loaded.device)
