"""Engine flags shared by `flowllm serve` and `flowllm generate`, named as vLLM's."""

from __future__ import annotations

import argparse
import os
from typing import Any

from flowllm.config import BUNDLED_MODEL, DTYPES, EngineConfig, engine_config


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
        help=f"a local directory, a Hub id (gpt2 = openai-community/gpt2) or the bundled "
        f"{BUNDLED_MODEL} (default)",
    )
    parser.add_argument("--served-model-name", help="the name clients use (default: MODEL)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    parser.add_argument("--max-model-len", type=int, help="context length (default: model's)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-memory", type=_bytes, default=2 * 2**30, help="KV cache bytes on CPU (2GiB)"
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="KV cache share of a GPU"
    )
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never replay recorded decode steps; run every step op by op",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-logprobs", type=int, default=20)
    parser.add_argument("--chat-template", help="a Jinja chat template file")
    parser.add_argument("--graph", help="run this graph YAML instead of the default one")
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
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "seed": args.seed,
        "max_logprobs": args.max_logprobs,
        "chat_template": args.chat_template,
    }
    return engine_config(args.model, **settings)
