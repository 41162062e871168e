"""Engine configuration: frozen msgspec Structs, the one place where defaults live.

Each Struct validates itself when built, so a bad value fails once, at startup, with a
message naming the field.
"""

from __future__ import annotations

from typing import Any

import msgspec

BUNDLED_MODEL = "smollm2-135m-instruct"
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8")
# What a model is served for, vLLM's `--task` (flowllm.models.pooler_config): auto reads the
# checkpoint; embed and score serve the pooling graph.
TASKS = ("auto", "generate", "embed", "score")


# The `--tool-call-parser` values (flowllm.api.tool_calls reads the output with them).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Which model to load and how."""

    model: str = BUNDLED_MODEL
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    chat_template: str | None = None  # path to a Jinja template overriding the model's
    tokenizer: str | None = None  # a directory whose tokenizer replaces the model's
    # auto: GGUF weights stay quantized; none: dequantized at load; int8: float weights
    # quantized per output channel (flowllm.models.loader.load_model)
    quantization: str = "auto"
    seed: int = 0
    enforce_eager: bool = False  # never replay decode steps (recorded kernel calls, CUDA graphs)
    # CUDA: the decode batch sizes captured as CUDA graphs at start-up (vLLM's names).
    # None: 1, 2, 4, 8 and every multiple of 8 up to max_cudagraph_capture_size.
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    # None: max_num_seqs, at most 512 for the default sizes (decode_buckets.capture_sizes)
    max_cudagraph_capture_size: int | None = None
    task: str = "auto"

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.task in TASKS, f"task must be one of {TASKS}, got {self.task!r}")
        _require(
            self.quantization in QUANTIZATIONS,
            f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1, got {self.max_model_len}",
        )
        _require(
            all(n >= 1 for n in self.cudagraph_capture_sizes or ()),
            f"cudagraph_capture_sizes must be >= 1, got {self.cudagraph_capture_sizes}",
        )
        _require(
            self.max_cudagraph_capture_size is None or self.max_cudagraph_capture_size >= 0,
            f"max_cudagraph_capture_size must be >= 0, got {self.max_cudagraph_capture_size}",
        )

    @property
    def name(self) -> str:
        """The name clients use in the `model` field."""
        return self.served_model_name or self.model


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The paged KV cache."""

    block_size: int = 16
    kv_cache_memory: int = 2 * 1024**3  # bytes, on CPU
    gpu_memory_utilization: float = 0.9  # this engine's share of a GPU, weights included
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(self.kv_cache_memory > 0, "kv_cache_memory must be > 0")
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Continuous batching limits."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # A prompt may run in chunks over several steps; off, a step holds each prompt whole
    # (what an encoder needs, and a pooler that reads every row).
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one request may ask for at most; a request beyond any bound is a 400 naming it.

    Each bound is checked before anything proportional to it is built (mailbox, sampler
    state, stop tables), so no single request can stall or exhaust the server. The CLI
    flags' help (flowllm/engine/args.py) says why each default was chosen.
    """

    max_n: int = 16  # choices per prompt
    max_logprobs: int = 20  # logprobs, top_logprobs and prompt_logprobs (vLLM's default)
    max_prompts_per_request: int = 256  # prompts in one completion request
    max_stop_strings: int = 16
    max_stop_string_length: int = 256  # characters
    max_stop_token_ids: int = 256
    max_logit_bias: int = 300  # entries of logit_bias
    max_json_depth: int = 64  # nesting of arrays and objects in a request body
    max_request_tokens: int = 2**20  # prompts x n x max_tokens (None: the context length)
    max_structured_output_chars: int = 65536  # a JSON schema's text, a regex, a grammar
    max_choices: int = 256  # entries of a `choice` constraint
    max_tools: int = 128  # functions in `tools`
    max_chat_template_kwargs: int = 64  # variables in `chat_template_kwargs`
    max_chat_template_kwargs_chars: int = 65536  # `chat_template_kwargs` as JSON text
    max_chat_template_kwargs_depth: int = 8  # nesting of its objects and arrays

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            low = 0 if name in _ZERO_ALLOWED else 1
            _require(value >= low, f"{name} must be >= {low}, got {value}")


# Limits that may be 0: the feature is then refused altogether.
_ZERO_ALLOWED = ("max_logprobs", "max_stop_strings", "max_stop_token_ids", "max_logit_bias")


# The speculative methods served (`SpeculativeConfig.method`), and the bound on drafts.
SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# The longest n-gram prompt lookup matches: each step tries every length down to the
# shortest, for every drafting sequence.
MAX_PROMPT_LOOKUP = 64
# What a draft model's KV cache may take by default, in bytes on its device: a small
# draft's K/V for tens of thousands of tokens.
DRAFT_KV_CACHE_MEMORY = 256 * 1024**2


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding, vLLM's `--speculative-config`: `method` proposes up to
    `num_speculative_tokens` drafts per sequence and step, which the model verifies exactly.
    ngram: prompt lookup over n-grams of `prompt_lookup_min` to `prompt_lookup_max` tokens.
    draft_model: the greedy continuation of `model`, a smaller checkpoint with the target's
    vocabulary, run in `dtype` (None: the target's), its weights loaded as `quantization`
    says (as `--quantization`: auto keeps a GGUF file quantized, int8 quantizes a float
    checkpoint's linear layers) with a KV cache of at most `draft_kv_cache_memory` bytes.
    The method defaults to draft_model when `model` is given, as vLLM infers it, else to
    ngram. A step with more than `disable_by_batch_size` running sequences runs without
    drafts (None: never steps aside)."""

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = 8
    model: str | None = None
    dtype: str | None = None
    quantization: str = "auto"
    draft_kv_cache_memory: int = DRAFT_KV_CACHE_MEMORY

    def __post_init__(self) -> None:
        if self.method is None:
            inferred = "ngram" if self.model is None else "draft_model"
            msgspec.structs.force_setattr(self, "method", inferred)
        _require(
            self.method in SPECULATIVE_METHODS,
            f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}",
        )
        drafting = self.method == "draft_model"
        _require(
            not drafting or bool(self.model),
            "model must name the draft model (a path or a Hugging Face Hub id) for method "
            "'draft_model'",
        )
        _require(
            drafting or (self.model is None and self.dtype is None),
            f"model and dtype name a draft model, which method {self.method!r} does not run",
        )
        _require(
            self.quantization in QUANTIZATIONS,
            f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        _require(
            drafting or self.quantization == "auto",
            f"quantization applies to a draft model, which method {self.method!r} does not run",
        )
        _require(
            self.dtype is None or self.dtype in DTYPES,
            f"dtype must be one of {DTYPES}, got {self.dtype!r}",
        )
        _require(
            self.draft_kv_cache_memory > 0,
            f"draft_kv_cache_memory must be > 0, got {self.draft_kv_cache_memory}",
        )
        _require(
            1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
            f"got {self.num_speculative_tokens}",
        )
        _require(
            self.prompt_lookup_min >= 1,
            f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}",
        )
        _require(
            self.prompt_lookup_max <= MAX_PROMPT_LOOKUP,
            f"prompt_lookup_max must be <= {MAX_PROMPT_LOOKUP}, got {self.prompt_lookup_max}",
        )
        _require(
            self.prompt_lookup_max >= self.prompt_lookup_min,
            f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
            f"({self.prompt_lookup_min})",
        )
        _require(
            self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
            f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}",
        )


def speculative_config(
    value: SpeculativeConfig | dict[str, Any] | str, name: str = "speculative_config"
) -> SpeculativeConfig:
    """A SpeculativeConfig from itself, a dict or JSON text; a bad value raises ConfigError
    naming `name` (the setting, or the CLI flag) and what is wrong."""
    if isinstance(value, SpeculativeConfig):
        return value
    try:
        if isinstance(value, str):
            return msgspec.json.decode(value, type=SpeculativeConfig)
        return msgspec.convert(value, SpeculativeConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ConfigError(f"{name}: {e}") from None


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the engine stages need, built once from CLI flags or LLM(...) arguments."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    limits: RequestLimits = msgspec.field(default_factory=RequestLimits)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding


_SECTIONS: dict[str, type[msgspec.Struct]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "limits": RequestLimits,
}


def engine_config(model: str | None = None, **settings: Any) -> EngineConfig:
    """An EngineConfig from flat settings named as the CLI flags (unknown names raise)."""
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    top: dict[str, Any] = {}
    for key, value in settings.items():
        section = next((n for n, s in _SECTIONS.items() if key in s.__struct_fields__), None)
        if section is not None:
            sections[section][key] = value
        elif key in EngineConfig.__struct_fields__ and key not in _SECTIONS:
            top[key] = value
        elif key == "speculative_config":  # vLLM's name (LLM(speculative_config=...))
            top["speculative"] = value
        else:
            raise TypeError(f"unknown engine setting {key!r}")
    if model is not None:
        sections["model"]["model"] = model
    if top.get("speculative") is not None:
        top["speculative"] = speculative_config(top["speculative"])
    return EngineConfig(
        model=ModelConfig(**sections["model"]),
        cache=CacheConfig(**sections["cache"]),
        scheduler=SchedulerConfig(**sections["scheduler"]),
        limits=RequestLimits(**sections["limits"]),
        **top,
    )
