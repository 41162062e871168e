"""Pieces shared by the model files: linear layers with prepacked weights, norms, rotary
embeddings, paged attention, and the bookkeeping that maps checkpoint names to them.

Linear weights: a layer loads its weight as [out, in] (torch's convention). Once a model
has loaded its checkpoint it calls `pack_linears`, which packs every weight into one of two
layouts (`weight_layout`); one packing serves every row count:
  - native: fp32, and bf16 where the CPU has AVX512-BF16, wherever the C kernels build
    (`flowllm.kernels.native`). W is cut into 16-output blocks stored column by column and
    products run `flowllm.kernels.cpu_linear`, which streams each block as one run.
  - oneDNN: fp16 where oneDNN supports it, and fp32/bf16 where the native kernel cannot
    run. `torch.ops.mkldnn._reorder_linear_weight` (the op torch's CPU compiler packs
    weights with: fp32 AB16b64a, bf16 AB16b64a2b), products by
    `torch.ops.mkldnn._linear_pointwise`, the fastest of the oneDNN, MKL and `F.linear`
    products tried.
Native replaced oneDNN outright for the dtypes it serves: at few rows it reads weights
faster (one run per 16 outputs, and a call's fixed cost below oneDNN's before it reads a
byte), from 16 rows both meet at the core's FMA rate, and no row count favours oneDNN, so
each weight keeps one copy (benchmarks/README.md "Linear step" has the figures).
It pads out to a multiple of 16 and (bf16) in to even: +15 rows on GPT-2's 50257-row LM
head, nothing on the other shapes.

A packed weight does not keep W's rows whole (oneDNN's is opaque; the native layout
interleaves 16 rows), so rows cannot be gathered from it: a tied embedding keeps the
plain [vocab, dim] table for itself (`Embedding.untie`) and the LM head packs its own
copy (a tied fp32 GPT-2 holds its 154 MB table twice). Packing frees each plain weight:
`Linear.weight` is None afterwards and `dense_weight()` rebuilds it; loading a checkpoint
tensor into a packed layer unpacks it first, and `load_weights` packs again at its end.
Elsewhere (CUDA, half precision neither serves, CPUs and builds with neither) weights stay
[out, in] and products run `F.linear`.

oneDNN caches every product it compiles, one per row count: `onednn_caches` bounds those
caches, on import of this module, before any product runs.

Quantized weights (`flowllm.kernels.quant_linear`): a GGUF file's quantized tensors load as
QuantizedWeight parts of a layer's rows, kept as they are, and `pack` fuses the parts into
one QuantizedLinear (a layer part quantized, part not is dequantized whole, exactly).
`quantize="int8"` (`pack_linears(model, "int8")`) quantizes a float layer's weight per
output channel instead of packing it.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from flowllm import kernels
from flowllm.kernels import cpu_linear, fused
from flowllm.kernels.quant_linear import QuantizedLinear, QuantizedWeight, int8_per_channel
from flowllm.kernels.vectorwise import vectorwise
from flowllm.models import onednn_caches
from flowllm.models.context import AttentionContext
from flowllm.models.errors import UnsupportedModelError, WeightLoadError

onednn_caches.bound_caches()  # before this module's first product (see onednn_caches)

Loader = Callable[[torch.Tensor], None]
Weight = torch.Tensor | QuantizedWeight  # what a checkpoint yields for a tensor
WeightLayout = Literal["native", "onednn", "plain"]


def config_get(config: Any, name: str, default: Any = None) -> Any:
    """Read a field from a transformers config object or a plain dict."""
    if isinstance(config, Mapping):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """A field as the config gives it, None included; `default` only where it is absent
    (for a field whose absence means a default and whose null means "none")."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def refuse_options(config: Any, model: str, names: Iterable[str]) -> None:
    """UnsupportedModelError naming every option of `names` the config sets (to anything
    but None, False or 0): options that change the model and that flowllm does not run."""
    set_ = [f"{name}={config_get(config, name)!r}" for name in names if config_get(config, name)]
    if set_:
        raise UnsupportedModelError(
            f"{model} with {', '.join(set_)} is not supported (flowllm does not implement "
            f"{'that option' if len(set_) == 1 else 'those options'})"
        )


def onednn_packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can pack linear weights of `dtype` on `device`."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(ops._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(ops._is_mkldnn_fp16_supported())
    return False


def weight_layout(dtype: torch.dtype, device: torch.device) -> WeightLayout:
    """Where linear weights of `dtype` on `device` go once loaded (see the module docstring):
    the native kernel's layout, oneDNN's, or they stay plain [out, in]."""
    if device.type == "cpu" and cpu_linear.serves(dtype):
        return "native"
    if onednn_packs(dtype, device):
        return "onednn"
    return "plain"


def batch_layout(dtype: torch.dtype, device: torch.device) -> WeightLayout:
    """The layout for a layer that multiplies hundreds of rows at a time (an encoder's whole
    prompts): oneDNN's where it packs the dtype, whose blocked products (AMX tiles on CPUs
    that have them) beat the native kernel's, built for decode's few rows, by several times
    there (benchmarks/README.md, "Embeddings"); else plain."""
    return "onednn" if onednn_packs(dtype, device) else "plain"


def check_shape(name: str, tensor: Weight, expected: tuple[int, ...]) -> None:
    """Raise WeightLoadError naming the tensor and both shapes when they differ."""
    if tuple(tensor.shape) != tuple(expected):
        raise WeightLoadError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(expected)}"
        )


def _check_inputs(weight: QuantizedWeight, inputs: int) -> None:
    if weight.shape[1] != inputs:
        raise WeightLoadError(f"a quantized weight of {weight.shape[1]} inputs for {inputs}")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b with W loaded as [out, in] and packed after loading, for the native
    kernel or oneDNN (see the module docstring); fused layers load their checkpoint shards
    into row ranges of W."""

    packed_weight: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        out_dtype: torch.dtype | None = None,
        quantizable: bool = True,
        layout: WeightLayout | None = None,
    ) -> None:
        """layout: where the weight goes once packed (default: `weight_layout`'s choice)."""
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        # False: `pack_linears` keeps it float under int8 quantization (a MoE router)
        self.quantizable = quantizable
        # The output's dtype: the weight's, or float32 for an LM head, whose logits the
        # native kernel hands out unrounded (bf16 logits merge near-ties: ulp 0.125 at 25).
        self.out_dtype = dtype if out_dtype is None else out_dtype
        self.layout = weight_layout(dtype, device) if layout is None else layout
        # The plain weight [out, in] while loading; None once packed.
        self.weight: nn.Parameter | None = _frozen(
            torch.empty(out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = _frozen(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        # Once packed, one of: W in the native kernel's layout, or oneDNN's opaque blocked
        # copy (a buffer, not in the state dict: it is derived).
        self.native_weight: cpu_linear.PackedLinear | None = None
        self.register_buffer("packed_weight", None, persistent=False)
        # Quantized checkpoint parts (first row, weight) until packed; then their product.
        self.quant_parts: list[tuple[int, QuantizedWeight]] = []
        self.quantized: QuantizedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, in] -> [n, out]
        if self.quantized is not None:
            return self.quantized(x)
        if self.native_weight is not None:
            return self.native_weight(x.contiguous())
        y: torch.Tensor
        if self.packed_weight is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        else:
            y = F.linear(x, self._plain(), self.bias)
        return y.to(self.out_dtype)

    @property
    def packs(self) -> bool:
        """Whether `pack` replaces the plain weight (and frees it)."""
        return self.layout != "plain"

    def _plain(self) -> torch.Tensor:
        """The plain [out, in] weight; raises once packing has freed it (see `unpack`)."""
        if self.weight is None:
            raise WeightLoadError(
                "this linear layer's plain weight was freed by packing; unpack() it first"
            )
        return self.weight

    def pack(self, quantize: str | None = None) -> None:
        """Pack W for this layer's layout and free the plain copy (where it packs): its
        quantized parts fused when they cover every row, else dequantized into the plain
        weight; a float weight quantized when `quantize` is "int8" (on the CPU)."""
        if self.quant_parts:
            parts, self.quant_parts = sorted(self.quant_parts, key=lambda p: p[0]), []
            if self.weight is not None and sum(w.shape[0] for _, w in parts) == self.out_features:
                self._quantize(QuantizedWeight.concat([w for _, w in parts]))
                return
            with torch.no_grad():
                for start, w in parts:
                    self._plain()[start : start + w.shape[0]].copy_(w.dequantize())
        if quantize == "int8" and self.weight is not None and self.weight.device.type == "cpu":
            self._quantize(int8_per_channel(self.weight))
            return
        if not self.packs or self.weight is None:
            return
        with torch.no_grad():
            plain = self._plain().detach()
            if self.layout == "native":
                self.native_weight = cpu_linear.PackedLinear(plain, self.bias, self.out_dtype)
            else:
                self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(plain)
        self.weight = None

    def _quantize(self, weight: QuantizedWeight) -> None:
        self.use_product(self.quantized_product(weight))

    def quantized_product(self, weight: QuantizedWeight) -> QuantizedLinear:
        """This layer's product over `weight` (its rows in order, or interleaved already),
        checked against the layer's shape; the layer is left as it is."""
        _check_inputs(weight, self.in_features)
        return QuantizedLinear(weight, self.bias, self.out_dtype, rows=self.out_features)

    def use_product(self, product: QuantizedLinear) -> None:
        """Run on `product` (from `quantized_product`), freeing the plain weight."""
        self.quant_parts = []
        self.quantized = product
        self.weight = None

    def unpack(self) -> None:
        """Back to a plain [out, in] weight (to load into it)."""
        if self.weight is not None:
            return
        self.weight = _frozen(self.dense_weight())
        self.native_weight = None
        self.packed_weight = None
        self.quantized = None

    def dense_weight(self) -> torch.Tensor:
        """W as [out, in]: the plain weight, or a plain copy of the packed one."""
        if self.quantized is not None:
            return self.quantized.dequantize().to(self.dtype)
        if self.native_weight is not None:
            return self.native_weight.unpack()
        if self.packed_weight is not None:
            return self.packed_weight.to_dense()
        return self._plain()

    @property
    def weight_bytes(self) -> int:
        """Bytes of W (what a product reads), whichever layout holds it."""
        if self.quantized is not None:
            return self.quantized.nbytes
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.in_features * self.out_features * itemsize

    def load_weight(
        self,
        name: str,
        w: Weight,
        start: int = 0,
        rows: int | None = None,
        transposed: bool = False,
    ) -> None:
        """Copy a checkpoint weight, [rows, in] (or [in, rows] if `transposed`, as GPT-2's
        Conv1D stores it), into output rows start:start+rows (rows default: the rest); a
        quantized one is kept as it is, for `pack` to fuse."""
        rows = self.out_features - start if rows is None else rows
        expect = (self.in_features, rows) if transposed else (rows, self.in_features)
        check_shape(name, w, expect)
        self.unpack()
        self.quant_parts = [(s, p) for s, p in self.quant_parts if s != start]
        if isinstance(w, QuantizedWeight):
            self.quant_parts.append((start, w))
            return
        with torch.no_grad():
            self._plain()[start : start + rows].copy_(w.t() if transposed else w)

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


class Embedding(nn.Module):
    """A token embedding table [num, dim]: its own, or a tied LM head's plain weight until
    that head is packed (`untie` then hands the table over)."""

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
        # The tied head is not a submodule here (the model owns it).
        self._tied = [tied_to] if tied_to is not None else []
        self.dtype = dtype
        self.weight: nn.Parameter | None = None
        if tied_to is None:
            self.weight = _frozen(torch.empty(num, dim, dtype=dtype, device=device))
        # A quantized table: rows dequantized as they are gathered (a tied head reads the
        # same codes).
        self.quantized: QuantizedLinear | None = None

    def table(self) -> torch.Tensor:
        """The [num, dim] table rows are gathered from."""
        if self.weight is not None:
            return self.weight
        return self._tied[0]._plain()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [n] -> [n, dim]
        if self.quantized is not None:
            return self.quantized.rows(ids.to(torch.int64)).to(self.dtype)
        return self.table().index_select(0, ids)

    def quantized_product(self, weight: QuantizedWeight) -> QuantizedLinear:
        """The table's rows over `weight` (in order, or interleaved already), checked
        against the table's shape; the table is left as it is."""
        _check_inputs(weight, self.dim)
        return QuantizedLinear(weight, None, self.dtype, rows=self.num)

    def use_product(self, product: QuantizedLinear) -> None:
        """Gather rows from `product` (from `quantized_product`): the codes replace the
        float table."""
        self.quantized = product
        self.weight = None

    def untie(self) -> None:
        """Keep the tied head's plain weight as this table, before the head packs (and frees)
        its own; a no-op for untied embeddings, quantized tables and heads that stay plain."""
        if self.weight is None and self.quantized is None and self._tied[0].packs:
            self.weight = _frozen(self._tied[0]._plain().detach())

    def load(self, name: str, w: Weight) -> None:
        """Copy the checkpoint's [num, dim] table (into the tied head too when tied); a
        quantized table is kept quantized."""
        check_shape(name, w, (self.num, self.dim))
        if isinstance(w, QuantizedWeight):
            self.use_product(self.quantized_product(w))
        elif self.weight is not None:
            self.quantized = None
            with torch.no_grad():
                self.weight.copy_(w)
        if self._tied:
            self._tied[0].load_weight(name, w)


def pack_linears(model: nn.Module, quantize: str | None = None) -> None:
    """Pack every linear layer of `model` (tied embeddings take their plain table first);
    with `quantize` ("int8"), quantize every float one but the LM head and the layers
    built not `quantizable`, as vLLM does.

    Packing is a strided copy per weight in torch ops, which release the GIL: the layers
    pack on every core at once. The first packs alone, as it may build the kernels."""
    for module in model.modules():
        if isinstance(module, Embedding):
            module.untie()
    head = getattr(model, "lm_head", None)
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    if not linears:
        return

    def pack(linear: Linear) -> None:
        linear.pack(None if linear is head or not linear.quantizable else quantize)

    pack(linears[0])
    with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="flowllm-pack") as pool:
        for _ in pool.map(pack, linears[1:]):
            pass


def quantized_formats(model: nn.Module) -> list[str]:
    """The formats its quantized linear layers came from (Q4_1, int8...), sorted."""
    return sorted(
        {
            m.quantized.weight.source
            for m in model.modules()
            if isinstance(m, Linear) and m.quantized
        }
    )


class ResidualNorm(nn.Module, abc.ABC):
    """A norm that can take the residual add before it (vLLM's layout: each layer hands its
    output and the residual stream to the next norm, which adds them). Where the native
    kernels serve the tensor (`flowllm.kernels.fused`) one C call does both; elsewhere,
    `torch_forward` after a torch add."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, dim]
        if self.serves_fused(x) and x.is_contiguous():
            return self.fused(x, None)
        return self.torch_forward(x)

    def serves_fused(self, x: torch.Tensor) -> bool:
        """Whether the native kernel computes this norm of x (and its residual add)."""
        return fused.serves(x)

    @abc.abstractmethod
    def fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The native kernel's norm of x (+ residual, written back)."""

    @abc.abstractmethod
    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of x by torch ops."""

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), fused where the native kernels serve (which
        write the sum into `residual`)."""
        # x, residual: [n, dim]
        if self.serves_fused(x) and x.is_contiguous() and residual.is_contiguous():
            return self.fused(x, residual), residual
        h = residual + x
        return self.forward(h), h


class LayerNorm(ResidualNorm):
    """LayerNorm with weight and bias, as in GPT-2."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _frozen(torch.ones(dim, dtype=dtype, device=device))
        self.bias = _frozen(torch.zeros(dim, dtype=dtype, device=device))

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return fused.layer_norm(x, self.weight, self.bias, self.eps, residual)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class RMSNorm(ResidualNorm):
    """RMSNorm computed in float32 and cast back before the weight, as Llama defines it."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _frozen(torch.ones(dim, dtype=dtype, device=device))

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps, residual)

    def load(self, name: str, w: torch.Tensor) -> None:
        """Copy the checkpoint's weight."""
        check_shape(name, w, tuple(self.weight.shape))
        with torch.no_grad():
            self.weight.copy_(w)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """fp32: torch's op (the same numbers, fewer ops). Half precision: the transformers
        formula, in place on the float32 copy."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h.mul_(h.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_())
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(ResidualNorm):
    """Gemma's RMSNorm: x normalized and scaled by (1 + w) in float32, rounded once.

    `weight` holds 1 + w in float32 (what llama.cpp's Gemma files store): a float32 model
    runs it through the native kernel, whose float32 math is this formula; a half-precision
    one through torch, since the kernel rounds the normalized row before the weight."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _frozen(torch.ones(dim, dtype=torch.float32, device=device))

    def load(self, name: str, w: torch.Tensor) -> None:
        """Hold 1 + the checkpoint's w."""
        check_shape(name, w, tuple(self.weight.shape))
        with torch.no_grad():
            self.weight.copy_(1.0 + w.float())

    def serves_fused(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and fused.serves(x)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps, residual)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE from cos and signed-sin tables indexed by position (grown on demand).

    The model looks the step's positions up once (`lookup`) and every layer rotates its
    queries and keys with `apply_rotary`. `attention_scaling` multiplies cos and sin
    (yarn's and LongRoPE's factor), before they are rounded, as transformers does."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        self.inv_freq = inv_freq.to(device)  # [rot_dim / 2] float32
        self.dtype = dtype
        self.attention_scaling = attention_scaling
        self._build(max(max_positions, 1))

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)  # [n, rot_dim / 2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        # [n, 2, rot_dim]: (cos | cos) and (-sin | sin), rounded to the model's dtype as
        # transformers rounds them, so x * cos + roll(x) * sin is rotate-half RoPE.
        self.table = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), 1)

    def lookup(
        self, positions: torch.Tensor, max_position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each [n, 1, rot_dim], of `positions` [n], all below
        `max_position` (a host-side bound, so growing the table never waits on the device)."""
        if max_position > self.table.shape[0]:
            self._build(max_position)
        rows = self.table.index_select(0, positions)  # [n, 2, rot_dim]
        return rows[:, :1], rows[:, 1:]

    def for_step(self, positions: torch.Tensor, max_position: int) -> StepRotary:
        """The rotation of one step's `positions` [n], all below `max_position`."""
        if max_position > self.table.shape[0]:
            self._build(max_position)
        return StepRotary(self, positions, max_position)


class StepRotary:
    """One step's rotary positions, applied by every layer to its fused q/k/v rows: by the
    native kernel in place where it serves, else by `apply_rotary` on table rows looked up
    once for the step."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, max_position: int):
        self.rotary = rotary
        self.positions = positions
        self.max_position = max_position
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def rotate(self, x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        """The first `heads` heads of each row of x, rotated: [n, heads, head_dim] (a view
        of x, rotated in place, where the native kernel serves; else a new tensor)."""
        # x: [n, row >= heads * head_dim] with unit column stride (a fused projection)
        n, width = x.shape[0], heads * head_dim
        table = self.rotary.table
        if fused.serves(x) and x.stride(1) == 1 and self.positions.dtype == torch.int64:
            fused.rope_(x, heads, head_dim, table, self.positions)
            return x[:, :width].view(n, heads, head_dim)
        if self._rows is None:
            self._rows = self.rotary.lookup(self.positions, self.max_position)
        return apply_rotary(x[:, :width].view(n, heads, head_dim), *self._rows)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of the first rot_dim dims of x's heads, into a new contiguous tensor:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), the rest copied. Rolling x by half the
    rotated width swaps x1 and x2, so the whole rotation is three ops."""
    # x: [n, heads, D] (any strides); cos, sin: [n, 1, rot_dim] from `lookup` -> [n, heads, D]
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return (x * cos).addcmul_(x.roll(rot // 2, -1), sin)
    part = x[..., :rot]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(part, cos, out=out[..., :rot]).addcmul_(part.roll(rot // 2, -1), sin)
    out[..., rot:] = x[..., rot:]
    return out


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU by torch's vector formula for every value (`vectorwise`); gated, the native
    kernel fuses it with its product where the kernels serve (`GatedActivation`)."""
    return vectorwise(F.silu, x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: one native call where the kernels serve, else torch's
    vector formula for every value (`vectorwise`)."""
    if fused.serves(x) and x.is_contiguous():
        return fused.gelu_tanh(x)
    # torch splits a tanh GELU of more than 6144 values among threads
    return vectorwise(partial(F.gelu, approximate="tanh"), x, serial_values=6144)


# Each value's activation is one formula whatever tensor holds it, so a row's does not
# depend on the rows beside it: SiLU and the tanh GELU by `vectorwise` where the native
# kernel does not run them; the erf GELU by oneDNN's kernel, which torch runs on contiguous
# float32 and bf16 tensors (pieces by size would only recompile it); ReLU exact.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu,
    "swish": silu,
    "gelu": F.gelu,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "relu": F.relu,
}


def activation(name: str, model: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config names; UnsupportedModelError naming the model otherwise."""
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"{model} activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


class GatedActivation(nn.Module):
    """act(gate) * up of a fused [gate | up] projection (SwiGLU and its kin); SiLU runs as
    one native call where the kernels serve."""

    def __init__(self, act: str, model: str) -> None:
        super().__init__()
        self.act = activation(act, model)
        self.is_silu = self.act is silu

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: [n, 2 * inter] -> [n, inter]
        if self.is_silu and fused.serves(gate_up) and gate_up.is_contiguous():
            return fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        # A contiguous gate takes the native activation where it has one; the activations
        # give every value one formula either way (see ACTIVATIONS).
        return self.act(gate.contiguous()) * up


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    ctx: AttentionContext,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Store this step's K/V in the layer's cache, then attend over each sequence's context
    (its last `window` positions under a sliding window; scores capped under a softcap)."""
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
        window,
        softcap,
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
