"""The model a trace was recorded on, for its replay: the one given, or rebuilt from the
named builder and seed the manifest records (checked against the recorded weights' hash),
and the recording engine's services around it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from flowllm.models.random_gpt2 import CheckpointBuildError, build_gpt2_dir
from flowllm.traces.manifest import ModelSource, weights_sha256
from flowllm.traces.trace import Trace

MODEL_BUILDERS: dict[str, Callable[..., Path]] = {"random-gpt2": build_gpt2_dir}


class TraceModelError(RuntimeError):
    """The trace's model can be neither found nor rebuilt."""


def resolve_model(trace: Trace, model: str | Path | None, cache_dir: Path | None) -> str:
    """The model to load: `model` if given, else rebuilt from the manifest's source, else
    the path or name recorded. A rebuilt or given directory must match the recorded
    weights' sha256."""
    info = trace.manifest.model
    if model is not None:
        chosen = Path(model)
    elif info.source is not None:
        chosen = build_model(info.source, info.weights_sha256, cache_dir)
    else:
        return info.path
    if info.weights_sha256 is not None and chosen.is_dir():
        found = weights_sha256(chosen)
        if found != info.weights_sha256:
            raise TraceModelError(
                f"model {chosen} has weights sha256 {found}, but the trace was recorded with "
                f"{info.weights_sha256}"
            )
    return str(chosen)


def build_model(source: ModelSource, sha: str | None, cache_dir: Path | None) -> Path:
    """Run the source's builder into the cache (once per weights hash) and return the dir."""
    from flowllm.cache_dir import flowllm_cache_dir

    base = (cache_dir or flowllm_cache_dir()) / "trace-models"
    key = hashlib.sha256(msgspec.json.encode(source)).hexdigest()[:24]
    dest = base / key
    if (dest / "config.json").is_file() and (sha is None or weights_sha256(dest) == sha):
        return dest
    builder = MODEL_BUILDERS.get(source.builder)
    if builder is None:
        raise TraceModelError(
            f"the trace's model comes from an unknown builder {source.builder!r} (known: "
            f"{', '.join(MODEL_BUILDERS)}); pass --model DIR"
        )
    tmp = base / f"{key}.partial"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        builder(tmp, **source.kwargs)
    except (CheckpointBuildError, TypeError) as e:
        raise TraceModelError(f"cannot rebuild the trace's model: {e}; pass --model DIR") from e
    if dest.exists():
        import shutil

        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def build_replay_services(trace: Trace, model_path: str, base: Any = None) -> Any:
    """The services the recording engine had, loading `model_path` in place of its model.

    `base`: services already holding that model (same path, dtype, quantization and chat
    template) whose model and tokenizer are reused, so replaying many traces loads the
    model once.
    """
    from flowllm.engine.loading import build_services, services_for_model
    from flowllm.stages.guide import has_guide

    config = trace.manifest.engine_config
    model_config = msgspec.structs.replace(
        config.model, model=model_path, served_model_name=config.model.name
    )
    config = msgspec.structs.replace(config, model=model_config)
    same_model = (
        base is not None
        and base.config.model.model == model_path
        and base.config.model.dtype == model_config.dtype
        and base.config.model.quantization == model_config.quantization
        and base.config.model.chat_template == model_config.chat_template
    )
    if same_model:
        services = services_for_model(
            config,
            base.model,
            base.tokenizer_loader,
            base.eos_token_ids,
            base.model_device(),
            base.pooler,
        )
    else:
        services = build_services(config)
    services.guided = has_guide(trace.graph)
    return services
