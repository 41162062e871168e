"""Rotary frequencies from a checkpoint's config: transformers' rope types default, linear,
llama3, yarn and longrope, each computed as transformers' `ROPE_INIT_FUNCTIONS` computes it.

A config carries its rope as transformers 5 writes it (`rope_parameters`, one dict, or one
per layer type: Gemma 3's `full_attention` and `sliding_attention`) or as older files do
(`rope_scaling` beside `rope_theta`); `rope_parameters` reads both. yarn and longrope also
scale cos and sin (`Rope.attention_scaling`), which `RotaryEmbedding` folds into its table.

LongRoPE has two sets of factors: transformers rotates by the short ones while a forward's
longest position is within `original_max_position_embeddings`, by the long ones past it,
so a sequence's rotation would depend on the batch it runs in and on how its prompt was
chunked. Here the set is chosen once, by the context the model serves (`context_len`): the
long factors when it reaches past the original context (as llama.cpp chooses by its
context size). Within the original context that is transformers' choice for every
sequence, and so it is for any prompt computed whole past it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from flowllm.models.errors import UnsupportedModelError
from flowllm.models.layers import config_get

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_SCALED = frozenset({"llama3", "yarn", "longrope"})  # types with an original context


@dataclass(frozen=True)
class Rope:
    """Inverse frequencies [rot_dim / 2] (float32) and the factor on cos and sin."""

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0


def rope_parameters(
    config: Any, layer_type: str | None = None, default_theta: float = 10000.0
) -> dict[str, Any]:
    """The rope parameters of `config` (of `layer_type`'s layers where they are given per
    layer type), with `rope_theta` and `rope_type` filled in from the older fields (the
    model's `default_theta` where neither gives one)."""
    params = dict(config_get(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), Mapping):
        params = dict(params[layer_type])
    scaling = dict(config_get(config, "rope_scaling", None) or {})
    params = {**scaling, **params}
    params.setdefault("rope_theta", float(config_get(config, "rope_theta", default_theta)))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_frequencies(
    config: Any,
    params: Mapping[str, Any],
    head_dim: int,
    context_len: int | None = None,
    model: str = "this model",
) -> Rope:
    """The frequencies `params` (from `rope_parameters`) give heads of `head_dim` (a partial
    rotary factor rotates the leading dims only). `context_len`: the longest sequence
    served (LongRoPE picks its factors by it), the config's maximum when None."""
    rope_type = str(params["rope_type"])
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{model}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    theta = float(params["rope_theta"])
    partial = float(
        params.get("partial_rotary_factor", config_get(config, "partial_rotary_factor", 1.0))
    )
    dim = int(head_dim * partial)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "default":
        return Rope(inv_freq)
    if rope_type == "linear":
        return Rope(inv_freq / float(params["factor"]))
    max_positions = int(config_get(config, "max_position_embeddings", 2048))
    # A config's own original context wins over its rope's, as transformers reads Phi-3's.
    original = int(
        config_get(
            config,
            "original_max_position_embeddings",
            params.get("original_max_position_embeddings", max_positions),
        )
    )
    if rope_type == "llama3":
        return Rope(_llama3(inv_freq, params, original))
    factor = params.get("factor")
    factor = max_positions / original if factor is None else float(factor)
    if rope_type == "yarn":
        return _yarn(theta**exponents, params, factor, dim, theta, original)
    return _longrope(params, factor, exponents, theta, original, context_len or max_positions)


def _llama3(inv_freq: torch.Tensor, params: Mapping[str, Any], original: int) -> torch.Tensor:
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(
    pos_freqs: torch.Tensor,
    params: Mapping[str, Any],
    factor: float,
    dim: int,
    theta: float,
    original: int,
) -> Rope:
    """YaRN: interpolated frequencies below a band of dims, extrapolated above it, a linear
    ramp across it; cos and sin scaled by the attention factor."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    return Rope(interpolated * (1 - extrapolation) + extrapolated * extrapolation, float(attention))


def _longrope(
    params: Mapping[str, Any],
    factor: float,
    exponents: torch.Tensor,
    theta: float,
    original: int,
    context_len: int,
) -> Rope:
    """LongRoPE: per-dim factors, the long set when the served context passes the original
    one (see the module docstring); cos and sin scaled by the attention factor."""
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    chosen = params["long_factor"] if context_len > original else params["short_factor"]
    factors = torch.tensor(chosen, dtype=torch.float32)
    if factors.shape != exponents.shape:
        raise UnsupportedModelError(
            f"longrope factors: {factors.numel()} given for {exponents.numel()} frequencies"
        )
    return Rope(1.0 / (factors * theta**exponents), float(attention))
