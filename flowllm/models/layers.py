"""Pieces shared by the model files: linear layers with a load-time weight layout, norms,
rotary embeddings, paged attention, and the bookkeeping that maps checkpoint names to them.

Weight layout: a linear layer stores its weight either as [out, in] (torch's convention,
run with `F.linear`) or transposed-contiguous as [in, out]. On CPU, fp32 products read an
[in, out] weight fastest, and bf16/fp16 ones an [out, in] weight; `prefer_in_out` picks
the layout once, at build time. fp32 products then run on oneDNN, which reads the
[in, out] storage through a transposed view: measured on the development machine (AMD Zen
4), it streams weights at ~27-30 GB/s single-threaded where MKL's GEMV reaches 19-25, and
MKL's GEMM with a few rows is 3-4x slower still. MKL (`x @ w`) is the fallback on builds
without oneDNN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flowllm import kernels
from flowllm.models.context import AttentionContext
from flowllm.models.errors import WeightLoadError

Loader = Callable[[torch.Tensor], None]


def config_get(config: Any, name: str, default: Any = None) -> Any:
    """Read a field from a transformers config object or a plain dict."""
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def prefer_in_out(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linear weights should be stored [in, out] (see the module docstring)."""
    return device.type == "cpu" and dtype == torch.float32


def _onednn_linear_op() -> Any:
    """oneDNN's linear (the op torch's CPU compiler lowers to), or None where unavailable."""
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Raise WeightLoadError naming the tensor and both shapes when they differ."""
    if tuple(tensor.shape) != tuple(expected):
        raise WeightLoadError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(expected)}"
        )


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b, with W stored [out, in] or [in, out] (`in_out`); fused layers load
    their checkpoint shards into row ranges of the output dimension."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        in_out: bool | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.in_out = prefer_in_out(dtype, device) if in_out is None else in_out
        shape = (in_features, out_features) if self.in_out else (out_features, in_features)
        self.weight = _frozen(torch.empty(shape, dtype=dtype, device=device))
        self.bias = _frozen(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self._onednn = _onednn_linear_op() if self.in_out and dtype == torch.float32 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, in] -> [n, out]
        if not self.in_out:
            return F.linear(x, self.weight, self.bias)
        if self._onednn is not None:
            # weight.t(): an [out, in] view of the [in, out] storage, which oneDNN reads as is
            return self._onednn(x, self.weight.t(), self.bias, "none", [], "")
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x, self.weight)

    def load_weight(
        self,
        name: str,
        w: torch.Tensor,
        start: int = 0,
        rows: int | None = None,
        transposed: bool = False,
    ) -> None:
        """Copy a checkpoint weight, [rows, in] (or [in, rows] if `transposed`, as GPT-2's
        Conv1D stores it), into output rows start:start+rows (rows default: the rest)."""
        rows = self.out_features - start if rows is None else rows
        expect = (self.in_features, rows) if transposed else (rows, self.in_features)
        check_shape(name, w, expect)
        out_in = w.t() if transposed else w  # [rows, in]
        with torch.no_grad():
            if self.in_out:
                self.weight[:, start : start + rows].copy_(out_in.t())
            else:
                self.weight[start : start + rows].copy_(out_in)

    def load_bias(
        self, name: str, b: torch.Tensor, start: int = 0, rows: int | None = None
    ) -> None:
        """Copy a checkpoint bias into output rows start:start+rows (rows default: the rest)."""
        if self.bias is None:
            raise WeightLoadError(f"checkpoint tensor {name!r}: this layer has no bias")
        rows = self.out_features - start if rows is None else rows
        check_shape(name, b, (rows,))
        with torch.no_grad():
            self.bias[start : start + rows].copy_(b)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W as [out, in] sees them: lets a tied embedding share this storage."""
        if self.in_out:
            return self.weight.index_select(1, ids).t()  # [n, in]
        return self.weight.index_select(0, ids)


class Embedding(nn.Module):
    """A token embedding table [num, dim], owned or read from a tied LM head's storage."""

    def __init__(
        self,
        num: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        tied_to: Linear | None = None,
    ) -> None:
        super().__init__()
        self.num, self.dim = num, dim
        # A tied embedding keeps no tensor of its own (the LM head is not a submodule here).
        self._tied = [tied_to] if tied_to is not None else []
        self.weight: nn.Parameter | None = None
        if tied_to is None:
            self.weight = _frozen(torch.empty(num, dim, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [n] -> [n, dim]
        if self.weight is None:
            return self._tied[0].weight_rows(ids)
        return self.weight.index_select(0, ids)

    def load(self, name: str, w: torch.Tensor) -> None:
        """Copy the checkpoint's [num, dim] table (into the tied head when tied)."""
        check_shape(name, w, (self.num, self.dim))
        if self.weight is None:
            self._tied[0].load_weight(name, w)
        else:
            with torch.no_grad():
                self.weight.copy_(w)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, as in GPT-2."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _frozen(torch.ones(dim, dtype=dtype, device=device))
        self.bias = _frozen(torch.zeros(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as Llama defines it."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _frozen(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: Any, head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies [rot_dim / 2] (float32), with `llama3` scaling when asked.

    Reads transformers' `rope_parameters` or the older `rope_scaling` + `rope_theta`.
    """
    params = dict(config_get(config, "rope_parameters", None) or {})
    scaling = dict(config_get(config, "rope_scaling", None) or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", config_get(config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = float(params.get("partial_rotary_factor", 1.0))
    dim = int(head_dim * partial)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type != "llama3":
        raise WeightLoadError(
            f"unsupported rope type {rope_type!r}; supported: default, linear, llama3"
        )
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    old_len = float(
        params.get(
            "original_max_position_embeddings",
            config_get(config, "max_position_embeddings", 8192),
        )
    )
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE from a cos/sin table indexed by position (grown on demand)."""

    def __init__(
        self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.inv_freq = inv_freq.to(device)  # [rot_dim / 2] float32
        self.dtype = dtype
        self._build(max(max_positions, 1))

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)  # [n, rot_dim / 2]
        self.cos = freqs.cos().to(self.dtype)
        self.sin = freqs.sin().to(self.dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [n]; q: [n, H, D]; k: [n, kvh, D] -> rotated copies of both
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            self._build(int(positions.max()) + 1)
        cos = self.cos.index_select(0, positions)[:, None, :]  # [n, 1, rot/2]
        sin = self.sin.index_select(0, positions)[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    rot = x[..., : 2 * half]
    x1, x2 = rot[..., :half], rot[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if 2 * half == x.shape[-1]:
        return out
    return torch.cat((out, x[..., 2 * half :]), dim=-1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    ctx: AttentionContext,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V in the layer's cache, then attend over each sequence's context."""
    # q: [n, H, D]; k, v: [n, kvh, D] -> [n, H * D]
    k_cache, v_cache = kv_cache
    kernels.store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
    out = kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        ctx.block_tables,
        ctx.query_start_loc,
        ctx.seq_lens,
        scale,
        ctx.max_query_len,
        ctx.max_seq_len,
        ctx.workspace,
    )
    return out.reshape(q.shape[0], -1)


class WeightMap:
    """Checkpoint name -> loader, with the prefixes and buffers checkpoints carry.

    Names are matched after stripping one known prefix, so `transformer.h.0.ln_1.weight`
    and `h.0.ln_1.weight` load the same tensor. `finish()` raises for anything missing.
    """

    def __init__(
        self,
        prefixes: tuple[str, ...],
        ignored_suffixes: tuple[str, ...],
        optional: frozenset[str] = frozenset(),
    ) -> None:
        self.prefixes = prefixes
        self.ignored_suffixes = ignored_suffixes
        self.optional = optional
        self.loaders: dict[str, Loader] = {}
        self.loaded: set[str] = set()

    def add(self, name: str, loader: Loader) -> None:
        self.loaders[name] = loader

    def canonical(self, name: str) -> str:
        for prefix in self.prefixes:
            if name.startswith(prefix):
                return name[len(prefix) :]
        return name

    def load_all(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for raw_name, tensor in weights:
            if raw_name.endswith(self.ignored_suffixes):
                continue
            name = self.canonical(raw_name)
            loader = self.loaders.get(name)
            if loader is None:
                raise WeightLoadError(
                    f"checkpoint tensor {raw_name!r} does not belong to this model"
                )
            loader(tensor)
            self.loaded.add(name)
        missing = sorted(set(self.loaders) - self.loaded - self.optional)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise WeightLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
