"""Loading a model into the services the stages share: weights, tokenizer, KV cache."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import structlog
import torch

from flowllm import openmp
from flowllm.config import ConfigError, EngineConfig
from flowllm.kernels import native
from flowllm.models.causal_lm import PagedCausalLM
from flowllm.models.draft import DraftModel, check_draft, drafts_with_model, load_draft
from flowllm.models.kv_cache import KVCacheSpec, allocate_kv_cache
from flowllm.models.layers import Linear, quantized_formats
from flowllm.models.loader import LoadedModel, load_model
from flowllm.models.pooler_config import PoolerConfig
from flowllm.models.tokenizer import load_tokenizer, tokenizer_source
from flowllm.stages.execute import model_runner
from flowllm.stages.services import EngineServices

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from flowllm.models.bert import BertModel


def eos_token_ids(
    loaded: LoadedModel, tokenizer: Callable[[], PreTrainedTokenizerBase]
) -> tuple[int, ...]:
    """The generation config's EOS ids (an int or a list), else the tokenizer's (loaded
    only then)."""
    eos = loaded.generation_config.get("eos_token_id")
    if eos is None:
        eos = getattr(loaded.hf_config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids:
        fallback = tokenizer().eos_token_id
        ids = [] if fallback is None else [fallback]
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
    log.info(
        "model weights",
        linear_mib=round(weights / 2**20, 1),
        quantized=",".join(quantized_formats(loaded.model)) or "none",
        dtype=str(loaded.dtype).removeprefix("torch."),
    )


def build_services(config: EngineConfig, *, tokenizer_now: bool = True) -> EngineServices:
    """Load the model and tokenizer and allocate the KV cache for `config`.

    The load runs in a thread of its own that ends with it: its parallel regions open an
    OpenMP pool that goes with that thread, so the caller's thread (an event loop's, or a
    user's) keeps none, and the model's thread has the process's one pool
    (flowllm/openmp.py). The tokenizer loads in another thread while the weights
    load: most of its time is importing transformers, which overlaps with reading and
    packing weights (native code that releases the GIL). `tokenizer_now` False: it loads
    on first use instead (the engine core, whose stages need it only for grammars: a
    thread beside the weights would slow their loading by its share of the interpreter)."""
    check_draft(config)  # a bad draft model fails before the target loads
    services = openmp.in_passing_thread(_loaded_services, config, tokenizer_now)
    if services.device is not None and services.device.type == "cuda":
        model_runner(services)  # kernels compiled, graphs captured: before serving
    return services


def _loaded_services(config: EngineConfig, tokenizer_now: bool) -> EngineServices:
    load = functools.partial(load_tokenizer, *tokenizer_source(config))
    tokenizer_loader: Callable[[], PreTrainedTokenizerBase]
    if tokenizer_now:
        tokenizer_loader = openmp.in_thread(load, name="flowllm-tokenizer")
        loaded = _load_model(config)
        tokenizer_loader()
    else:
        tokenizer_loader = functools.cache(load)
        loaded = _load_model(config)
    report_native_kernels(loaded)
    return services_for_model(
        config,
        loaded.model,
        tokenizer_loader,
        eos_token_ids(loaded, tokenizer_loader),
        loaded.device,
        loaded.pooler,
    )


def _load_model(config: EngineConfig) -> LoadedModel:
    return load_model(
        config.model.model,
        config.model.dtype,
        config.model.device,
        config.model.quantization,
        config.model.task,
    )


def model_bytes(model: torch.nn.Module) -> int:
    """What the model's parameters and buffers take, each storage counted once (tied
    embeddings share one). A tensor without a storage of its own (oneDNN's packed
    weights) counts its elements."""
    storages: dict[int, int] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        try:
            storage = t.untyped_storage()
        except NotImplementedError:  # an opaque tensor (a packed weight)
            storages[id(t)] = t.numel() * t.element_size()
            continue
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def services_for_model(
    config: EngineConfig,
    model: PagedCausalLM | BertModel,
    tokenizer_loader: Callable[[], PreTrainedTokenizerBase],
    eos_token_ids: tuple[int, ...],
    device: torch.device,
    pooler: PoolerConfig | None = None,
) -> EngineServices:
    """The services of a loaded model under `config`: its context length checked against
    `config`'s, and a KV cache of `config`'s size allocated for it (an encoder has none);
    with a draft model (speculative decoding), the draft loaded beside it, whose weights
    and cache come out of a GPU's share before the target's cache. A model served for
    pooling (`pooler`) runs with its scheduling adjusted (`pooling_config`). The model's
    steps run on as many OpenMP threads as the calling thread's parallel regions do."""
    max_model_len = model.max_position_embeddings
    if pooler is not None and pooler.max_seq_length is not None:
        max_model_len = min(max_model_len, pooler.max_seq_length)
    if config.model.max_model_len is not None:
        if config.model.max_model_len > max_model_len:
            raise ConfigError(
                f"max_model_len={config.model.max_model_len} is longer than the model's "
                f"context of {max_model_len} tokens"
            )
        max_model_len = config.model.max_model_len
    config = pooling_config(config, pooler, max_model_len)
    draft: DraftModel | None = None
    if isinstance(model, PagedCausalLM):
        model.limit_context(max_model_len)
        taken = model_bytes(model)
        if config.speculative is not None and drafts_with_model(config):
            draft = load_draft(config.speculative, model, max_model_len, config.cache.block_size)
            taken += model_bytes(draft.model) + config.speculative.draft_kv_cache_memory
        spec = KVCacheSpec.for_model(model, config.cache.block_size)
        num_blocks, kv_caches = allocate_kv_cache(
            spec,
            device,
            config.cache.kv_cache_memory,
            config.cache.gpu_memory_utilization,
            taken,
        )
    else:
        model.limit_steps(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
        num_blocks, kv_caches = encoder_blocks(config, max_model_len), []
    return EngineServices(
        config=config,
        model=model,
        tokenizer_loader=tokenizer_loader,
        kv_caches=kv_caches,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids,
        device=device,
        pooler=pooler,
        draft=draft,
        model_threads=openmp.pool_size(),
    )


def pooling_config(
    config: EngineConfig, pooler: PoolerConfig | None, max_model_len: int
) -> EngineConfig:
    """`config` for a model served with `pooler`. A pooler that reads a prompt's every row,
    or an encoder's first, needs each prompt whole in one step: chunked prefill and the
    prefix cache (whose hits skip rows) are turned off, and a step's token budget holds
    the longest prompt, as vLLM does for such models. A decoder's last row comes at the
    end of its chunks: it keeps both."""
    if pooler is None or not pooler.whole_prompts:
        return config
    scheduler, cache = config.scheduler, config.cache
    budget = max(scheduler.max_num_batched_tokens, max_model_len)
    if scheduler.enable_chunked_prefill or cache.enable_prefix_caching:
        structlog.get_logger("flowllm.models").info(
            "pooling runs each prompt whole: chunked prefill and prefix caching off",
            pooling=pooler.pooling,
            max_num_batched_tokens=budget,
        )
    return msgspec.structs.replace(
        config,
        scheduler=msgspec.structs.replace(
            scheduler, enable_chunked_prefill=False, max_num_batched_tokens=budget
        ),
        cache=msgspec.structs.replace(cache, enable_prefix_caching=False),
    )


def encoder_blocks(config: EngineConfig, max_model_len: int) -> int:
    """The scheduler's block count for a model without a KV cache (an encoder): blocks are
    only its bookkeeping, so as many as one step of whole prompts takes (each prompt one
    partial block at most), and one longest prompt."""
    size = config.cache.block_size
    step = -(-config.scheduler.max_num_batched_tokens // size) + config.scheduler.max_num_seqs
    return max(step, -(-max_model_len // size))
