"""What the engine stages share, built once before the graph starts (by
flowllm/engine/loading.py).

The runtime hands this object to every stage constructor. Each piece still has exactly one
stage that edits it: the mailboxes belong to ingest (open) and deliver, the KV
cache tensors to execute, a draft model's KV cache to propose; the rest is read-only.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry

from flowllm.config import EngineConfig
from flowllm.mailbox import Mailboxes
from flowllm.messages import RequestError, StructuredOutputs
from flowllm.metrics import EngineMetrics
from flowllm.models.pooler_config import PoolerConfig
from flowllm.sampling.grammar import Grammars
from flowllm.stages.worker import WorkerThread
from flowllm.text.detokenizer import ByteVocab

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from flowllm.models.draft import DraftModel
    from flowllm.models.kv_cache import KVCaches

T = TypeVar("T")


@dataclass
class EngineServices:
    """The loaded model and everything the stages need to know about it."""

    config: EngineConfig
    model: Any  # a flowllm model (forward over a flattened batch + paged KV), or a stand-in
    # Returns the model's fast (Rust-backed) tokenizer; called on the first use of
    # `tokenizer`, so a process whose stages need none (the engine core without grammars)
    # never loads it.
    tokenizer_loader: Callable[[], PreTrainedTokenizerBase]
    kv_caches: KVCaches
    num_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    device: torch.device | None  # the model's; None in a front process, which runs none
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    mailboxes: Mailboxes = field(default_factory=Mailboxes)
    # Whether the graph has a guide stage, which constrained requests need (set by the
    # engine that builds the graph; validate refuses them without one).
    guided: bool = False
    # The OpenMP threads of the model's steps, in the one thread that runs them
    # (`model_thread`); every other thread runs torch work on one (flowllm/openmp.py)
    model_threads: int = 1
    # A model served for pooling (--task embed or score): how its vectors are made and
    # what requests may ask of them; None: a model served for generation.
    pooler: PoolerConfig | None = None
    # Speculative decoding with a draft model: the draft and its KV cache (propose's)
    draft: DraftModel | None = None
    # Where validate has a request's constraint compiled, (request id, constraint) -> its
    # error or None; None: here, with `grammars()`. A front asks its engine core.
    check_constraint: Callable[[str, StructuredOutputs], Awaitable[RequestError | None]] | None = (
        None
    )
    metrics: EngineMetrics = field(init=False)
    # Read-only data derived from the model or tokenizer, built on first use: one dict
    # shared by every `fresh` copy, so whichever copy builds an entry, all reuse it; one
    # build at a time (stages build from their threads).
    _derived: dict[str, Any] = field(default_factory=dict, repr=False)
    _derived_lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    # The stages' worker threads by name, shared by every `fresh` copy likewise.
    _workers: dict[str, WorkerThread] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.metrics = EngineMetrics(self.registry, self.max_model_len)
        self.metrics.live_mailboxes.set_function(lambda: len(self.mailboxes))

    def model_device(self) -> torch.device:
        """The model's device, for the stages that run the model."""
        if self.device is None:
            raise RuntimeError("this process holds no model (a front): its stages cannot run here")
        return self.device

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer: PreTrainedTokenizerBase = self.shared("tokenizer", self.tokenizer_loader)
        return tokenizer

    def byte_vocab(self) -> ByteVocab | None:
        """The tokenizer's byte table for fast decoding (None: not a byte-level tokenizer).
        Built once for all runs: it walks the whole vocabulary (benchmarks/README.md,
        "Start-up")."""
        vocab: ByteVocab | None = self.shared("byte_vocab", lambda: ByteVocab.of(self.tokenizer))
        return vocab

    def grammars(self) -> Grammars:
        """The grammar compiler and cache for this tokenizer, built on first use: its
        tokenizer tables cover the whole vocabulary (benchmarks/README.md, "Grammar
        engines")."""
        return self.shared(
            "grammars", lambda: Grammars(self.tokenizer, self.logits_size, self.eos_token_ids)
        )

    def share_derived_with(self, other: EngineServices) -> None:
        """Use `other`'s derived entries from now on, before any is built here: a front
        connecting to the same core again (an offline `generate` call each) reuses the
        tables its tokenizer took a walk over the vocabulary to build."""
        self._derived, self._derived_lock = other._derived, other._derived_lock

    def shared(self, name: str, build: Callable[[], T]) -> T:
        """The entry `name` that every `fresh` copy shares, built by `build` on first use."""
        with self._derived_lock:
            if name not in self._derived:
                self._derived[name] = build()
            entry: T = self._derived[name]
        return entry

    @property
    def logits_size(self) -> int:
        """The width of the model's logits rows (a grammar's bitmask covers them all)."""
        size = getattr(self.model, "vocab_size", None)
        return len(self.tokenizer) if size is None else int(size)

    def worker_thread(self, name: str) -> WorkerThread:
        """The thread the stage called `name` runs its per-step torch work in, on one OpenMP
        thread, kept for these services' lifetime (flowllm/stages/worker.py). Replicas of a
        stage share it."""
        return self._worker(name, 1)

    def model_thread(self) -> WorkerThread:
        """The one thread that runs the model's steps, the target's and a draft's, on the
        process's one OpenMP pool of `model_threads`."""
        return self._worker("model", self.model_threads)

    def step_thread(self, name: str) -> WorkerThread:
        """The thread where the stage called `name` runs a step's torch work after the
        model's (sampling): on a CPU the model's, whose pool has the cores (the step's
        forward is done by then, and a large batch's logits are read faster on them all);
        on a GPU a thread of its own, so that its wait for the device's results does not
        hold up the next step's launches."""
        if self.model_device().type == "cpu":
            return self.model_thread()
        return self.worker_thread(name)

    def _worker(self, name: str, pool_threads: int) -> WorkerThread:
        worker = self._workers.get(name)
        if worker is None:
            worker = self._workers[name] = WorkerThread(f"flowllm-{name}", pool_threads)
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
            tokenizer_loader=self.tokenizer_loader,
            kv_caches=self.kv_caches,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
            guided=self.guided,
            model_threads=self.model_threads,
            pooler=self.pooler,
            draft=self.draft,
            _derived=self._derived,
            _derived_lock=self._derived_lock,
            _workers=self._workers,
        )


def already_loaded(tokenizer: PreTrainedTokenizerBase) -> Callable[[], PreTrainedTokenizerBase]:
    """The `tokenizer_loader` of a tokenizer in hand."""
    return lambda: tokenizer
