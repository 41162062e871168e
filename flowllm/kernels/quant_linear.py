"""Linear weights kept quantized: llama.cpp's GGUF block formats and int8 per channel, with
products by `csrc/quant.c`, which dequantizes in registers as it reads.

Why: a batch-1 decode step is bound by the bytes of weight it reads. SmolLM2's Q4_1 file
dequantized to bf16 is ~270 MB a token; its quantized blocks are ~80 MB.

Every format is repacked at load into one of two code layouts the kernel reads, rows of W
[n, k] cut into groups of G values along k with one scale s and one offset m per group
(a value is q * s + m, the fma gguf's own dequantization rounds the same way):
  - q4: 4-bit codes, 64 values in 32 bytes (byte j: q[j] | q[j + 32] << 4, so one load
    and two masks give them in order), G 32: Q4_0 (m = -8 s), Q4_1, Q4_K (s = d * sc,
    m = -dmin * min); rows of a multiple of 64 values (else they take the q8 layout);
  - q8: int8 codes: Q8_0, Q5_K (codes 0-31, G 32), Q6_K (codes -32..31, G 16), int8.
Scales and offsets stay float16 where the format stores them so (Q4_0, Q4_1, Q8_0: 5 and
8.5 bits a value, as in the file), float32 where they are products (the K formats).
Fused layers (q/k/v, gate/up) concatenate their parts' rows; parts of different layouts
meet in the widest (q8, float32 scales, the smaller group).

The kernel multiplies groups of 32 or more on integers, x rounded to int8 a block of 32
as llama.cpp does (`csrc/quant.c` says how, and the error's bound); Q6_K's groups of 16
dequantize to float32 in registers. x and y are float32 or, in a bf16 model, bf16 as they
are (the kernel widens x as it reads it and rounds y once), so a bf16 model keeps its bf16
KV cache and attention with quantized weights, and its decode steps record without a
conversion.

Every product runs that kernel, whatever its number of rows (decode steps, recorded and
replayed by `flowllm.kernels.call_plan`, prefills, mixed steps): it takes 16 outputs at a
time, their codes unpacked once and dotted with up to 8 rows of x (4 on AVX2), so an extra
row costs byte dots and a scale, not another unpack. It reads each 16 rows' codes and
scales interleaved (`QuantizedWeight.interleave`), which QuantizedLinear makes once at load
for every weight multiplied on integers, so a step reads them in the order it uses them.

Why one path: a row's result is then a function of that row alone (its int8 rounding, its
sums in a fixed order), so a sequence's logits do not depend on the other sequences of
its step, on how its prompt was chunked, or on a recompute after preemption. Choosing a
path by the step's size (dequantized tiles for prefills, as before) made them depend on
all three. Without the native library, products multiply dequantized float32 tiles by
torch in blocks of ROW_BLOCK rows of x, padded, so that each call has the same shape
whatever the step holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from flowllm.kernels import native

Codes = Literal["q4", "q8"]
TILE_VALUES = 1 << 20  # weight values dequantized per tile (4 MiB of float32), torch path
ROW_BLOCK = 16  # rows of x per torch product, padded: one shape for every call
LANES = 16  # rows of the interleaved layout's groups
QK_K = 256  # values per K-format super-block

# GGUF quantization types by name (gguf.GGMLQuantizationType), what they repack from.
GGUF_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


class QuantError(ValueError):
    """A quantized tensor cannot be built or used as asked (shape, format, arguments)."""


@dataclass(frozen=True)
class QuantizedWeight:
    """W [n, k] as codes, scales and offsets (see the module docstring); `source` names the
    format it came from (Q4_1, int8, ...)."""

    codes: torch.Tensor  # q4: uint8 [n, k / 2]; q8: int8 [n, k]
    scales: torch.Tensor  # [n, k / group], float16 or float32
    mins: torch.Tensor | None  # like scales, or None (all offsets 0)
    kind: Codes
    group: int
    source: str
    interleaved: bool = False  # each 16 rows' codes, scales, offsets interleaved (`interleave`)
    # what `interleave` made of this weight: one copy for every product over it (a tied
    # embedding table and LM head)
    _grouped: QuantizedWeight | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.interleaved and (n % LANES or not self.integer):
            raise QuantError(f"{self.kind} rows of {k} in groups of {self.group} cannot interleave")
        width = k // 2 if self.kind == "q4" else k
        bad_q4 = self.kind == "q4" and (self.group != 32 or k % 64)
        if bad_q4 or self.group % 16 or k % self.group or self.codes.shape != (n, width):
            raise QuantError(
                f"{self.kind} codes {tuple(self.codes.shape)} do not fit groups of {self.group}"
            )
        if self.scales.shape != (n, k // self.group) or self.scales.dtype not in (
            torch.float16,
            torch.float32,
        ):
            raise QuantError(f"scales {tuple(self.scales.shape)} {self.scales.dtype} do not fit")
        if self.mins is not None and (
            self.mins.shape != self.scales.shape or self.mins.dtype != self.scales.dtype
        ):
            raise QuantError("offsets must match the scales in shape and dtype")

    @property
    def shape(self) -> tuple[int, int]:
        n = self.codes.shape[0]
        k = self.scales.shape[1] * self.group
        return n, k

    @property
    def integer(self) -> bool:
        """Whether products multiply these codes on integers (else in float32 registers)."""
        return self.group % 32 == 0 and self.shape[1] % 64 == 0

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: codes, scales and offsets."""
        extra = 0 if self.mins is None else self.mins.nbytes
        return self.codes.nbytes + self.scales.nbytes + extra

    def interleave(self) -> QuantizedWeight:
        """The layout the 16-row group kernel reads: rows padded with zeros to a multiple
        of 16, then each 16 rows' codes as [row bytes / 4][16] dwords (4 bytes of each row at
        a time) and their scales and offsets as [k / group][16]; the same shape [n', k].
        Made once: every call returns the same weight."""
        if self.interleaved:
            return self
        if self._grouped is not None:
            return self._grouped
        pad = -self.shape[0] % LANES
        padded = [self.codes, self.scales, self.mins]
        if pad:
            padded = [None if t is None else F.pad(t, (0, 0, 0, pad)) for t in padded]
        codes, scales, mins = (
            None if t is None else _interleave(t, 4 if i == 0 else t.element_size())
            for i, t in enumerate(padded)
        )
        assert codes is not None and scales is not None
        grouped = replace(self, codes=codes, scales=scales, mins=mins, interleaved=True)
        object.__setattr__(self, "_grouped", grouped)
        return grouped

    def in_rows(self) -> QuantizedWeight:
        """The row layout of these values (pad rows included)."""
        if not self.interleaved:
            return self
        codes, scales, mins = (
            None if t is None else _interleave(t, 4 if i == 0 else t.element_size(), inverse=True)
            for i, t in enumerate((self.codes, self.scales, self.mins))
        )
        assert codes is not None and scales is not None
        return replace(self, codes=codes, scales=scales, mins=mins, interleaved=False)

    def int_codes(self) -> torch.Tensor:
        """The codes as int16 [n, k]."""
        if self.interleaved:
            return self.in_rows().int_codes()
        n, k = self.shape
        if self.kind == "q8":
            return self.codes.to(torch.int16)
        c = self.codes.view(n, k // 64, 32)
        return torch.cat((c & 15, c >> 4), dim=-1).reshape(n, k).to(torch.int16)

    def dequantize(self) -> torch.Tensor:
        """W [n, k] float32, by torch: each value q * s + m, rounded once as the kernel's fma
        (q * s is exact in float32 for every format)."""
        if self.interleaved:
            return self.in_rows().dequantize()
        n, k = self.shape
        w = torch.empty(n, k // self.group, self.group, dtype=torch.float32)
        if self.kind == "q8":
            w.view(n, k).copy_(self.codes)
        else:  # each 64 values: the low nibbles of 32 bytes, then their high nibbles
            codes, halves = self.codes.view(n, k // 64, 32), w.view(n, k // 64, 2, 32)
            halves[:, :, 0] = codes & 15
            halves[:, :, 1] = codes >> 4
        w.mul_(self.scales.to(torch.float32).unsqueeze(-1))
        if self.mins is not None:
            w.add_(self.mins.to(torch.float32).unsqueeze(-1))
        return w.view(n, k)

    def row_range(self, row0: int, count: int) -> QuantizedWeight:
        """Rows row0 .. row0 + count - 1, in rows: views of these where they are in rows."""
        if self.interleaved:
            return self.take_rows(torch.arange(row0, row0 + count))
        end = row0 + count
        return replace(
            self,
            codes=self.codes[row0:end],
            scales=self.scales[row0:end],
            mins=None if self.mins is None else self.mins[row0:end],
        )

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` (a permutation or selection), in that order, in rows."""
        if self.interleaved:
            return self.in_rows().take_rows(index)
        return replace(
            self,
            codes=self.codes.index_select(0, index).contiguous(),
            scales=self.scales.index_select(0, index).contiguous(),
            mins=None if self.mins is None else self.mins.index_select(0, index).contiguous(),
        )

    def widened(self, group: int, with_mins: bool) -> QuantizedWeight:
        """The same values as q8 codes with float32 scales in groups of `group` (a divisor
        of this one's): the layout parts of different formats share once fused."""
        if self.group % group:
            raise QuantError(f"groups of {self.group} cannot split into groups of {group}")
        if self.interleaved:
            return self.in_rows().widened(group, with_mins)
        if (
            self.kind == "q8"
            and self.group == group
            and self.scales.dtype == torch.float32
            and (self.mins is not None or not with_mins)
        ):
            return self
        codes = self.int_codes().to(torch.int8)
        repeat = self.group // group
        scales = self.scales.to(torch.float32).repeat_interleave(repeat, dim=1)
        mins = None
        if with_mins:
            mins = (
                torch.zeros_like(scales)
                if self.mins is None
                else self.mins.to(torch.float32).repeat_interleave(repeat, dim=1)
            )
        return QuantizedWeight(codes, scales.contiguous(), mins, "q8", group, self.source)

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The rows of `parts` one after another (a fused q/k/v or gate/up weight)."""
        parts = [p.in_rows() for p in parts]
        if len(parts) == 1:
            return parts[0]
        ks = {p.shape[1] for p in parts}
        if len(ks) != 1:
            raise QuantError(f"fused parts have different inputs: {sorted(ks)}")
        first = parts[0]
        same = all(
            p.kind == first.kind
            and p.group == first.group
            and p.scales.dtype == first.scales.dtype
            and (p.mins is None) == (first.mins is None)
            for p in parts
        )
        if not same:
            group = math.gcd(*(p.group for p in parts))
            with_mins = any(p.mins is not None for p in parts)
            parts = [p.widened(group, with_mins) for p in parts]
            first = parts[0]
        sources = "+".join(dict.fromkeys(p.source for p in parts))
        return QuantizedWeight(
            codes=torch.cat([p.codes for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
            mins=None if first.mins is None else torch.cat([p.mins for p in parts]),  # type: ignore[misc]
            kind=first.kind,
            group=first.group,
            source=sources,
        )


# ----------------------------------------------------------------------------------------
# From GGUF blocks and from float weights


def _interleave(t: torch.Tensor, width: int, inverse: bool = False) -> torch.Tensor:
    """[n, c] (n a multiple of 16) with each 16 rows' runs of `width` bytes transposed:
    [n / 16][runs per row][16 rows][width]; or (inverse) back. The same shape and dtype."""
    n, c = t.shape
    items = t.contiguous().view(torch.uint8).view(n // LANES, LANES, -1, width)
    if inverse:
        items = items.view(n // LANES, -1, LANES, width)
    return items.transpose(1, 2).contiguous().view(t.dtype).view(n, c)


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16).reshape(a.shape[:-1])


def _q4(q: np.ndarray, scales: np.ndarray, mins: np.ndarray, source: str) -> QuantizedWeight:
    """uint8 codes [n, k] (each < 16) in groups of 32: the q4 layout, 64 values in 32 bytes,
    or, for rows that are not whole 64s, the q8 one."""
    n, k = q.shape
    t = torch.from_numpy
    if k % 64:
        codes = t(np.ascontiguousarray(q.view(np.int8)))
        return QuantizedWeight(codes, t(scales), t(mins), "q8", 32, source)
    g = q.reshape(n, k // 64, 2, 32)
    packed = np.ascontiguousarray((g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2))
    return QuantizedWeight(t(packed), t(scales), t(mins), "q4", 32, source)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> (sc, min), each [.., 8]."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 [n, bytes per row], as gguf's reader maps them) of
    the format `type_name` (a GGUF_FORMATS entry) and shape [n, k], repacked."""
    n, k = shape
    if type_name not in GGUF_FORMATS:
        raise QuantError(f"GGUF type {type_name} is not served quantized")
    block = QK_K if type_name.endswith("_K") else 32
    if k % block:
        raise QuantError(f"{type_name} rows of {k} values are not whole blocks of {block}")
    raw = np.asarray(data, dtype=np.uint8).reshape(n, k // block, -1)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    if type_name in ("Q4_0", "Q4_1"):
        d = np.ascontiguousarray(_f16(raw[..., 0:2]))
        if type_name == "Q4_0":
            m, qs = (np.float16(-8) * d).astype(np.float16), raw[..., 2:18]
        else:
            m, qs = np.ascontiguousarray(_f16(raw[..., 2:4])), raw[..., 4:20]
        q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # [n, k / 32, 32] in order
        return _q4(q.reshape(n, k), d, m, type_name)
    if type_name == "Q8_0":
        d = _f16(raw[..., 0:2])
        qs = raw[..., 2:34].view(np.int8)
        return QuantizedWeight(t(qs.reshape(n, k)), t(d), None, "q8", 32, type_name)
    if type_name in ("Q4_K", "Q5_K"):
        d = _f16(raw[..., 0:2]).astype(np.float32)[..., None]
        dmin = _f16(raw[..., 2:4]).astype(np.float32)[..., None]
        sc, mn = _k_scales(raw[..., 4:16])
        scales = (d * sc.astype(np.float32)).reshape(n, k // 32)
        mins = -(dmin * mn.astype(np.float32)).reshape(n, k // 32)
        if type_name == "Q4_K":
            qs = raw[..., 16:144].reshape(n, k // QK_K, 4, 1, 32)
            q = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
            return _q4(q.reshape(n, k), scales, np.ascontiguousarray(mins), type_name)
        qh = raw[..., 16:48].reshape(n, k // QK_K, 1, 32)
        qs = raw[..., 48:176].reshape(n, k // QK_K, 4, 1, 32)
        low = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
        high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 0x01
        q = low.reshape(n, k // QK_K, 8, 32) | (high << 4)
        codes = q.reshape(n, k).view(np.int8)
        return QuantizedWeight(t(codes), t(scales), t(mins), "q8", 32, type_name)
    # Q6_K: ql 128, qh 64, int8 scales 16, d f16
    ql = raw[..., 0:128].reshape(n, k // QK_K, 2, 1, 64)
    qh = raw[..., 128:192].reshape(n, k // QK_K, 2, 1, 32)
    sc = raw[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(raw[..., 208:210]).astype(np.float32)[..., None]
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    q = low.reshape(n, k // QK_K, 2, 4, 32) | (high.reshape(n, k // QK_K, 2, 4, 32) << 4)
    codes = (q.astype(np.int16) - 32).astype(np.int8).reshape(n, k)
    scales = (d * sc).reshape(n, k // 16)
    return QuantizedWeight(t(codes), t(scales), None, "q8", 16, type_name)


def int8_per_channel(w: torch.Tensor) -> QuantizedWeight:
    """W [n, k] (float) as int8 codes with one float32 scale per output row (absmax / 127),
    vLLM's weight-only int8; k must be a multiple of 16."""
    k = w.shape[1]
    if k % 16:
        raise QuantError(f"int8 rows need a multiple of 16 inputs, got {k}")
    w32 = w.detach().to(torch.float32)
    scale = w32.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w32 / scale).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(codes.contiguous(), scale.contiguous(), None, "q8", k, "int8")


# ----------------------------------------------------------------------------------------
# Products


class QuantizedLinear:
    """y = x W^T + b over a QuantizedWeight: x [m, k] -> y [m, n] in `out_dtype`, sums in
    float32, the bias kept by reference. bf16 x, bias and y (a bf16 model's layers) go to
    the kernel as they are, so a recorded step needs no conversions; other mixes convert
    to float32 first. `rows`: W's rows, where `weight` is interleaved already and so
    carries pad rows (weights mapped from the cache: flowllm/models/weight_cache.py)."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
        lib: native.NativeLibrary | None = None,
        rows: int | None = None,
    ) -> None:
        n, self.in_features = weight.shape
        self.out_features = n if rows is None else rows
        self.lib = lib if lib is not None else native.library()
        if self.lib is not None and weight.integer:
            weight = weight.interleave()
        padded = self.out_features + (-self.out_features % LANES if weight.interleaved else 0)
        if weight.shape[0] != padded:
            raise QuantError(f"{weight.shape[0]} rows of codes do not hold {self.out_features}")
        self.weight = weight
        if bias is not None and bias.shape != (self.out_features,):
            raise QuantError(f"bias must be [{self.out_features}], got {tuple(bias.shape)}")
        self.bias = bias
        self.out_dtype = out_dtype

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: codes, scales and offsets."""
        return self.weight.nbytes

    def dequantize(self) -> torch.Tensor:
        """W [n, k] float32."""
        return self.weight.dequantize()[: self.out_features]

    def _bias32(self) -> torch.Tensor | None:
        if self.bias is None:
            return None
        return self.bias if self.bias.dtype == torch.float32 else self.bias.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [m, in] -> [m, out]
        n, k = self.out_features, self.in_features
        if x.dim() != 2 or x.shape[1] != k or not x.is_cpu:
            raise QuantError(f"x must be [m, {k}] on the CPU, got {tuple(x.shape)} {x.device}")
        m = x.shape[0]
        if self.lib is None:
            y = self._torch_product(x)
            return y if self.out_dtype == torch.float32 else y.to(self.out_dtype)
        bf16 = x.dtype == self.out_dtype == torch.bfloat16 and (
            self.bias is None or self.bias.dtype == torch.bfloat16
        )
        if bf16:
            x, bias, y = x.contiguous(), self.bias, torch.empty(m, n, dtype=torch.bfloat16)
        else:
            x, bias = x.to(torch.float32).contiguous(), self._bias32()
            y = torch.empty(m, n, dtype=torch.float32)
        w = self.weight
        try:
            torch.ops.flowllm.qlinear(x, w.codes, w.scales, w.mins, bias, y, w.group, w.interleaved)
        except ValueError as e:  # W in the other layout than its product reads
            raise QuantError(str(e)) from None
        return y if y.dtype == self.out_dtype else y.to(self.out_dtype)

    def _torch_product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b in float32 by torch, W dequantized one tile of rows at a time, each
        tile multiplied with ROW_BLOCK rows of x at a time (the last block padded with
        zeros), so that every product a row takes part in has the same shape."""
        n, k = self.out_features, self.in_features
        m = x.shape[0]
        rows_of_x = -(-m // ROW_BLOCK) * ROW_BLOCK
        xp = torch.zeros(rows_of_x, k, dtype=torch.float32)
        xp[:m] = x
        blocks = xp.view(-1, ROW_BLOCK, k)
        y = torch.empty(rows_of_x, n, dtype=torch.float32)
        step = max(LANES, TILE_VALUES // k // LANES * LANES)  # whole groups of 16 rows
        bias = self._bias32()
        for r0 in range(0, n, step):
            rows = min(step, n - r0)
            tile = self.rows(None, r0, rows)
            part_bias = None if bias is None else bias[r0 : r0 + rows]
            for b, block in enumerate(blocks):
                y[b * ROW_BLOCK : (b + 1) * ROW_BLOCK, r0 : r0 + rows] = F.linear(
                    block, tile, part_bias
                )
        return y[:m]

    def rows(self, ids: torch.Tensor | None, row0: int = 0, count: int = 0) -> torch.Tensor:
        """Rows of W as float32: W[ids] (int64 [r]), or W[row0 : row0 + count]."""
        n, k = self.out_features, self.in_features
        if ids is not None:
            if ids.dtype != torch.int64 or ids.dim() != 1:
                raise QuantError(f"row ids must be int64 [r], got {ids.dtype} {tuple(ids.shape)}")
            ids = ids.contiguous()
            count = ids.shape[0]
        elif row0 < 0 or count < 0 or row0 + count > n:
            raise QuantError(f"rows {row0}:{row0 + count} are outside [0, {n})")
        if self.lib is None:
            w = self.weight
            part = w.take_rows(ids) if ids is not None else w.row_range(row0, count)
            return part.dequantize()
        out = torch.empty(count, k, dtype=torch.float32)
        w = self.weight
        torch.ops.flowllm.dequant(
            w.codes, w.scales, w.mins, ids, row0, n, k, w.group, w.interleaved, out
        )
        return out
