"""What the engine stages share, built once before the graph starts.

The runtime hands this object to every stage constructor. Each piece still has exactly one
stage that edits it: the mailboxes belong to ingest (open) and format (deliver), the KV
cache tensors to execute; the rest is read-only.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from flowllm.config import ConfigError, EngineConfig
from flowllm.kernels import native
from flowllm.mailbox import Mailboxes
from flowllm.metrics import EngineMetrics
from flowllm.models.kv_cache import KVCaches, KVCacheSpec, allocate_kv_cache
from flowllm.models.layers import Linear
from flowllm.models.loader import LoadedModel, load_model, resolve_model
from flowllm.models.tokenizer import load_tokenizer
from flowllm.sampling.grammar import Grammars
from flowllm.stages.worker import WorkerThread
from flowllm.text.detokenizer import ByteVocab


@dataclass
class EngineServices:
    """The loaded model and everything the stages need to know about it."""

    config: EngineConfig
    model: Any  # a flowllm model (forward over a flattened batch + paged KV), or a stand-in
    tokenizer: Any  # transformers PreTrainedTokenizerFast
    kv_caches: KVCaches
    num_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    device: Any
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    mailboxes: Mailboxes = field(default_factory=Mailboxes)
    # Whether the graph has a guide stage, which constrained requests need (set by the
    # engine that builds the graph; validate refuses them without one).
    guided: bool = False
    metrics: EngineMetrics = field(init=False)
    # Read-only data derived from the model or tokenizer, built on first use: one dict
    # shared by every `fresh` copy, so whichever copy builds an entry, all reuse it.
    _derived: dict[str, Any] = field(default_factory=dict, repr=False)
    # The stages' worker threads by name, shared by every `fresh` copy likewise.
    _workers: dict[str, WorkerThread] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.metrics = EngineMetrics(self.registry, self.max_model_len)
        self.metrics.live_mailboxes.set_function(lambda: len(self.mailboxes))

    def byte_vocab(self) -> ByteVocab | None:
        """The tokenizer's byte table for fast decoding (None: not a byte-level tokenizer).
        ~0.1 s to build for a 50k vocabulary, so built once for all runs."""
        if "byte_vocab" not in self._derived:
            self._derived["byte_vocab"] = ByteVocab.of(self.tokenizer)
        vocab: ByteVocab | None = self._derived["byte_vocab"]
        return vocab

    def grammars(self) -> Grammars:
        """The grammar compiler and cache for this tokenizer (~0.15 s to build the
        tokenizer's tables, so built on the first constrained request)."""
        grammars = self._derived.get("grammars")
        if grammars is None:
            grammars = self._derived["grammars"] = Grammars(
                self.tokenizer, self.logits_size, self.eos_token_ids
            )
        return grammars

    @property
    def logits_size(self) -> int:
        """The width of the model's logits rows (a grammar's bitmask covers them all)."""
        size = getattr(self.model, "vocab_size", None)
        return len(self.tokenizer) if size is None else int(size)

    def worker_thread(self, name: str) -> WorkerThread:
        """The thread the stage called `name` runs its per-step torch work in, kept for
        these services' lifetime (flowllm/stages/worker.py). Replicas of a stage share it."""
        worker = self._workers.get(name)
        if worker is None:
            worker = self._workers[name] = WorkerThread(f"flowllm-{name}")
        return worker

    @property
    def vocab_size(self) -> int:
        """Token ids a request may name are below this: ids both the model's logits and
        embedding and the tokenizer know (the smaller of the two sizes)."""
        size = len(self.tokenizer)
        model_size = getattr(self.model, "vocab_size", None)
        return size if model_size is None else min(size, int(model_size))

    @property
    def served_model_name(self) -> str:
        return self.config.model.name

    def fresh(self) -> EngineServices:
        """The same model, tokenizer and KV cache with new mailboxes and metrics, for
        another run of a graph (the offline API starts one per `generate` call)."""
        return EngineServices(
            config=self.config,
            model=self.model,
            tokenizer=self.tokenizer,
            kv_caches=self.kv_caches,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
            guided=self.guided,
            _derived=self._derived,
            _workers=self._workers,
        )


def eos_token_ids(loaded: LoadedModel, tokenizer: Any) -> tuple[int, ...]:
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


def build_services(config: EngineConfig) -> EngineServices:
    """Load the model and tokenizer and allocate the KV cache for `config`.

    The tokenizer loads in a thread while the weights load: most of its time is importing
    transformers, which overlaps with reading and packing weights (native code that
    releases the GIL)."""
    # Resolving converts the bundled model if needed.
    resolved = resolve_model(config.model.model, config.model.quantization)
    if config.model.tokenizer is not None:
        tokenizer_args = (resolve_model(config.model.tokenizer).path, config.model.chat_template)
    else:
        gguf = resolved.gguf if resolved.config_from_gguf else None
        tokenizer_args = (resolved.path, config.model.chat_template, gguf)
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
    model = loaded.model
    max_model_len = model.max_position_embeddings
    if config.model.max_model_len is not None:
        if config.model.max_model_len > max_model_len:
            raise ConfigError(
                f"max_model_len={config.model.max_model_len} is longer than the model's "
                f"context of {max_model_len} tokens"
            )
        max_model_len = config.model.max_model_len
    spec = KVCacheSpec.for_model(model, config.cache.block_size)
    num_blocks, kv_caches = allocate_kv_cache(
        spec, loaded.device, config.cache.kv_cache_memory, config.cache.gpu_memory_utilization
    )
    return EngineServices(
        config=config,
        model=model,
        tokenizer=tokenizer,
        kv_caches=kv_caches,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids(loaded, tokenizer),
        device=loaded.device,
    )
