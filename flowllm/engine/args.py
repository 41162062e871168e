"""Engine flags shared by `flowllm serve` and `flowllm generate`, named as vLLM's."""

from __future__ import annotations

import argparse
import os
from typing import Any

from flowllm.config import (
    BUNDLED_MODEL,
    DTYPES,
    QUANTIZATIONS,
    TASKS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RequestLimits,
    SchedulerConfig,
    engine_config,
    speculative_config,
)

# The flags' defaults are the configs' own (flowllm/config.py), written once there.
_MODEL = ModelConfig()
_CACHE = CacheConfig()
_SCHEDULER = SchedulerConfig()
_LIMITS = RequestLimits()

# Each request limit's flag help: what it bounds, and why the default is what it is.
_LIMIT_HELP = {
    "max_n": "choices per prompt, `n` (%(default)s: enough for best-of-N sampling, and "
    "every choice holds a KV sequence)",
    "max_logprobs": "at most this many `logprobs`, `top_logprobs` and `prompt_logprobs` "
    "(%(default)s, as vLLM's default and OpenAI's top_logprobs maximum)",
    "max_prompts_per_request": "prompts in one completion request (%(default)s, the ingest "
    "channel's capacity: a request is admitted whole, so more could never be admitted)",
    "max_stop_strings": "stop strings per request (%(default)s; OpenAI allows 4, vLLM any "
    "number; each is searched for in every choice's new text)",
    "max_stop_string_length": "characters in one stop string (%(default)s; detokenize "
    "searches every new text for each, so their length bounds a step's work)",
    "max_stop_token_ids": "entries of `stop_token_ids` (%(default)s; each sequence "
    "keeps them in a set and a tensor)",
    "max_logit_bias": "entries of `logit_bias` (%(default)s, OpenAI's limit)",
    "max_json_depth": "nesting of arrays and objects in a request body (%(default)s; the "
    "API's deepest field is ~5 levels, and deep nesting costs the JSON decoder's stack)",
    "max_structured_output_chars": "characters of a JSON schema (as JSON text), regex or "
    "grammar constraint, choices together, or `tools` (%(default)s; checked before "
    "compiling, whose time grows with the constraint)",
    "max_choices": "entries of a `choice` constraint (%(default)s)",
    "max_tools": "functions in `tools` (%(default)s, OpenAI's limit)",
    "max_chat_template_kwargs": "variables in `chat_template_kwargs` (%(default)s; a "
    "template reads a few, such as enable_thinking)",
    "max_chat_template_kwargs_chars": "characters of `chat_template_kwargs` as JSON "
    "(%(default)s; its values may reach the prompt, which the template renders unbudgeted)",
    "max_chat_template_kwargs_depth": "nesting of objects and arrays in "
    "`chat_template_kwargs`, itself included (%(default)s)",
    "max_request_tokens": "prompts x n x max_tokens of one request, max_tokens unset "
    "counting as the context length (%(default)s: n=16 at a 64k context, or 256 prompts "
    "of 4096 tokens; bounds the work one request can queue)",
}


def _bytes(text: str) -> int:
    """`2147483648`, `2GiB`, `512MiB`, `1.5GB` -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for unit, scale in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * scale)
    return int(lowered)


def _names(text: str) -> list[str]:
    """`a.in,b.out` -> ["a.in", "b.out"]."""
    return [n.strip() for n in text.split(",") if n.strip()]


def add_engine_arguments(
    parser: argparse.ArgumentParser, *, model_optional: bool, log_level: str = "info"
) -> None:
    parser.add_argument(
        "model",
        nargs="?" if model_optional else None,
        default=BUNDLED_MODEL,
        help=f"a GGUF file, a local directory, a Hub id (gpt2 = openai-community/gpt2) or "
        f"the bundled {BUNDLED_MODEL} (default)",
    )
    parser.add_argument("--served-model-name", help="the name clients use (default: MODEL)")
    parser.add_argument("--dtype", choices=DTYPES, default=_MODEL.dtype)
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=_MODEL.quantization,
        help="auto: a GGUF file's quantized weights are served quantized (the bundled "
        "model's Q4_1 file too); none: dequantized at load, as the float model; "
        "int8: a float checkpoint's linear layers quantized to int8 per output channel "
        "(weights only)",
    )
    parser.add_argument(
        "--task",
        choices=TASKS,
        default=_MODEL.task,
        help="what the model is served for: generate (completions and chat), embed "
        "(/v1/embeddings; /v1/score and /v1/rerank by cosine similarity) or score (a "
        "cross-encoder: /v1/score, /v1/rerank); auto reads the checkpoint's architectures "
        "and sentence-transformers files",
    )
    parser.add_argument(
        "--tokenizer",
        help="a directory (or Hub id) whose tokenizer to use, for GGUF files without one",
    )
    parser.add_argument("--max-model-len", type=int, help="context length (default: model's)")
    parser.add_argument("--max-num-seqs", type=int, default=_SCHEDULER.max_num_seqs)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=_SCHEDULER.max_num_batched_tokens
    )
    parser.add_argument("--block-size", type=int, default=_CACHE.block_size)
    parser.add_argument(
        "--kv-cache-memory",
        type=_bytes,
        default=_CACHE.kv_cache_memory,
        help="KV cache bytes on CPU (%(default)s; 2GiB, 512MiB... accepted)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=_CACHE.gpu_memory_utilization,
        help="this engine's share of a GPU's total memory, weights and KV cache together "
        "(%(default)s); engines sharing a GPU each take their own",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_CACHE.enable_prefix_caching,
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=_SCHEDULER.enable_chunked_prefill,
        help="run a long prompt in chunks over several steps (off: each prompt whole in one "
        "step, which needs --max-num-batched-tokens >= the context length; a model served "
        "for pooling turns it off where its pooler reads every row)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never replay decode steps (recorded kernel calls on CPU, CUDA graphs on CUDA); "
        "run every step op by op",
    )
    parser.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        help="CUDA: the decode batch sizes captured as graphs at start-up (default: 1, 2, 4, "
        "8 and every multiple of 8 up to --max-cudagraph-capture-size)",
    )
    parser.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        help="CUDA: the largest decode batch captured (default: --max-num-seqs, at most 512 "
        "for the default sizes; 0 captures none); larger decode steps run eagerly",
    )
    parser.add_argument("--seed", type=int, default=_MODEL.seed)
    for name, text in _LIMIT_HELP.items():
        parser.add_argument(
            "--" + name.replace("_", "-"), type=int, default=getattr(_LIMITS, name), help=text
        )
    parser.add_argument("--chat-template", help="a Jinja chat template file")
    parser.add_argument("--graph", help="run this graph YAML instead of the default one")
    parser.add_argument(
        "--speculative-config",
        help="speculative decoding, as JSON (vLLM's): method ngram or draft_model (the "
        "default when model is given), num_speculative_tokens (1 to 16), "
        "disable_by_batch_size (more running sequences than this and a step runs without "
        "drafts; null: never); ngram: prompt_lookup_max, prompt_lookup_min; draft_model: "
        "model (a path or Hub id of a smaller model with the target's tokenizer), dtype "
        "(default: the target's), quantization (auto, none or int8, as --quantization), "
        "draft_kv_cache_memory (bytes, default 256 MiB); without "
        "--graph, runs the speculative graph (flowllm/engine/speculative.yaml)",
    )
    parser.add_argument(
        "--trace-dir", help="record every channel's messages and the spans into this directory"
    )
    parser.add_argument(
        "--trace-channels",
        type=_names,
        help="record only these channels (comma-separated, as `stage.port`)",
    )
    parser.add_argument(
        "--trace-max-bytes", type=_bytes, help="stop recording at this size (e.g. 64MiB)"
    )
    parser.add_argument("--log-level", default=os.environ.get("FLOWLLM_LOG_LEVEL", log_level))
    parser.add_argument(
        "--log-format",
        choices=("auto", "console", "json"),
        default=os.environ.get("FLOWLLM_LOG_FORMAT", "auto"),
    )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    settings: dict[str, Any] = {
        "served_model_name": args.served_model_name,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "tokenizer": args.tokenizer,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "enforce_eager": args.enforce_eager,
        "cudagraph_capture_sizes": (
            None if args.cuda_graph_sizes is None else tuple(args.cuda_graph_sizes)
        ),
        "max_cudagraph_capture_size": args.max_cudagraph_capture_size,
        "task": args.task,
        "seed": args.seed,
        **{name: getattr(args, name) for name in _LIMIT_HELP},
        "chat_template": args.chat_template,
        "speculative_config": (
            None
            if args.speculative_config is None
            else speculative_config(args.speculative_config, "--speculative-config")
        ),
    }
    return engine_config(args.model, **settings)
