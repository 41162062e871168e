"""Loading a model into the services the stages share: weights, tokenizer, KV cache."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from flowllm.config import ConfigError, EngineConfig
from flowllm.kernels import native
from flowllm.models.kv_cache import KVCacheSpec, allocate_kv_cache
from flowllm.models.layers import Linear
from flowllm.models.loader import LoadedModel, load_model, resolve_model
from flowllm.models.tokenizer import load_tokenizer
from flowllm.stages.services import EngineServices

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from flowllm.models.causal_lm import PagedCausalLM


def eos_token_ids(loaded: LoadedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The generation config's EOS ids (an int or a list), else the tokenizer's."""
    eos = loaded.generation_config.get("eos_token_id")
    if eos is None:
        eos = getattr(loaded.hf_config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return tuple(int(i) for i in ids)


def report_native_kernels(loaded: LoadedModel) -> None:
    """Say at startup which native kernel build runs, or why none does (a warning when
    kernels are off), and what the linear weights take."""
    log = structlog.get_logger("flowllm.models")
    if loaded.device.type != "cpu":
        return
    status = native.status()
    emit = log.info if status.isa == "avx512" else log.warning
    emit(status.describe())
    weights = sum(m.weight_bytes for m in loaded.model.modules() if isinstance(m, Linear))
    quantized = sorted(
        {
            m.quantized.weight.source
            for m in loaded.model.modules()
            if isinstance(m, Linear) and m.quantized
        }
    )
    log.info(
        "model weights",
        linear_mib=round(weights / 2**20, 1),
        quantized=",".join(quantized) or "none",
        dtype=str(loaded.dtype).removeprefix("torch."),
    )


def tokenizer_source(config: EngineConfig) -> tuple[Path, str | None, Path | None]:
    """`load_tokenizer`'s arguments for `config`. Resolving converts the bundled model
    if needed."""
    if config.model.tokenizer is not None:
        return resolve_model(config.model.tokenizer).path, config.model.chat_template, None
    resolved = resolve_model(config.model.model, config.model.quantization)
    gguf = resolved.gguf if resolved.config_from_gguf else None
    return resolved.path, config.model.chat_template, gguf


def build_services(config: EngineConfig) -> EngineServices:
    """Load the model and tokenizer and allocate the KV cache for `config`.

    The tokenizer loads in a thread while the weights load: most of its time is importing
    transformers, which overlaps with reading and packing weights (native code that
    releases the GIL)."""
    tokenizer_args = tokenizer_source(config)
    with ThreadPoolExecutor(1, thread_name_prefix="flowllm-tokenizer") as pool:
        tokenizer_loading = pool.submit(load_tokenizer, *tokenizer_args)
        try:
            loaded = load_model(
                config.model.model,
                config.model.dtype,
                config.model.device,
                config.model.quantization,
            )
        except BaseException:
            tokenizer_loading.cancel()
            raise
        tokenizer = tokenizer_loading.result()
    report_native_kernels(loaded)
    return services_for_model(
        config, loaded.model, tokenizer, eos_token_ids(loaded, tokenizer), loaded.device
    )


def model_bytes(model: torch.nn.Module) -> int:
    """What the model's parameters and buffers take, each storage counted once (tied
    embeddings share one)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in itertools.chain(model.parameters(), model.buffers())
    }
    return sum(storages.values())


def services_for_model(
    config: EngineConfig,
    model: PagedCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    eos_token_ids: tuple[int, ...],
    device: torch.device,
) -> EngineServices:
    """The services of a loaded model under `config`: its context length checked against
    `config`'s, and a KV cache of `config`'s size allocated for it."""
    max_model_len = model.max_position_embeddings
    if config.model.max_model_len is not None:
        if config.model.max_model_len > max_model_len:
            raise ConfigError(
                f"max_model_len={config.model.max_model_len} is longer than the model's "
                f"context of {max_model_len} tokens"
            )
        max_model_len = config.model.max_model_len
    model.limit_context(max_model_len)
    spec = KVCacheSpec.for_model(model, config.cache.block_size)
    num_blocks, kv_caches = allocate_kv_cache(
        spec,
        device,
        config.cache.kv_cache_memory,
        config.cache.gpu_memory_utilization,
        model_bytes(model),
    )
    return EngineServices(
        config=config,
        model=model,
        tokenizer=tokenizer,
        kv_caches=kv_caches,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids,
        device=device,
    )
