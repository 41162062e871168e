"""Comparing a replayed message with the recorded one: the path of the first difference.

Exact, except that request ids map one-to-one in order of appearance, `*_time` fields are
ignored, and tensors and floats are equal within `atol + rtol * |recorded|`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import torch

from flowllm.traces.codec import TensorDigest


class Comparer:
    """Walks two messages side by side; remembers the request-id bijection across calls."""

    def __init__(self, atol: float, rtol: float) -> None:
        self.atol = atol
        self.rtol = rtol
        self._ids: dict[str, str] = {}
        self._ids_back: dict[str, str] = {}

    def diff(self, rec: Any, rep: Any, path: str = "") -> str | None:
        """The path of the first difference, or None."""
        if isinstance(rec, (TensorDigest, torch.Tensor)):
            return self._tensor(rec, rep, path)
        if type(rec) is not type(rep) and not (
            isinstance(rec, (int, float)) and isinstance(rep, (int, float))
        ):
            return f"{path} (type {type(rec).__name__} vs {type(rep).__name__})"
        if isinstance(rec, msgspec.Struct):
            for name in rec.__struct_fields__:
                if name.endswith("_time"):
                    continue
                a, b = getattr(rec, name), getattr(rep, name)
                if name == "request_id" and isinstance(a, str) and isinstance(b, str):
                    if self._ids.setdefault(a, b) != b or self._ids_back.setdefault(b, a) != a:
                        return f"{path}.{name}"
                    continue
                found = self.diff(a, b, f"{path}.{name}")
                if found is not None:
                    return found
            return None
        if isinstance(rec, (tuple, list)):
            if len(rec) != len(rep):
                return f"{path} (length {len(rec)} vs {len(rep)})"
            for i, (a, b) in enumerate(zip(rec, rep, strict=True)):
                found = self.diff(a, b, f"{path}[{i}]")
                if found is not None:
                    return found
            return None
        if isinstance(rec, dict):
            if set(rec) != set(rep):
                return f"{path} (keys {sorted(rec)} vs {sorted(rep)})"
            for key in rec:
                found = self.diff(rec[key], rep[key], f"{path}[{key!r}]")
                if found is not None:
                    return found
            return None
        if isinstance(rec, float) and isinstance(rep, float) and rec != rep:
            if math.isnan(rec) or math.isnan(rep) or math.isinf(rec) or math.isinf(rep):
                return None if math.isnan(rec) and math.isnan(rep) else path
            return None if abs(rep - rec) <= self.atol + self.rtol * abs(rec) else path
        return None if rec == rep else path

    def _tensor(self, rec: Any, rep: Any, path: str) -> str | None:
        if not isinstance(rep, torch.Tensor):
            return f"{path} (tensor vs {type(rep).__name__})"
        if isinstance(rec, torch.Tensor):
            if tuple(rec.shape) != tuple(rep.shape):
                return f"{path} (shape {tuple(rec.shape)} vs {tuple(rep.shape)})"
            a, b = rec.to(torch.float64), rep.detach().cpu().to(torch.float64)
            ok = torch.allclose(b, a, atol=self.atol, rtol=self.rtol, equal_nan=True)
            return None if ok else f"{path} (max abs difference {(a - b).abs().max():.3g})"
        if tuple(rec.shape) != tuple(rep.shape):
            return f"{path} (shape {tuple(rec.shape)} vs {tuple(rep.shape)})"
        flat = rep.detach().cpu().to(torch.float64)
        rows = flat.reshape(1, -1) if flat.dim() < 2 else flat.flatten(1)  # [rows, cols]
        for r, (indices, values) in enumerate(zip(rec.indices, rec.values, strict=True)):
            got = rows[r, torch.tensor(indices, dtype=torch.int64)]
            want = torch.tensor(values, dtype=torch.float64)
            if not torch.allclose(got, want, atol=self.atol, rtol=self.rtol):
                return f"{path}[{r}] (top-k logits differ)"
            top = torch.topk(rows[r], len(values)).values
            if not torch.allclose(top, want, atol=self.atol, rtol=self.rtol):
                return f"{path}[{r}] (top-k set differs)"
        cols = rows.shape[1]
        sums = rows.sum(dim=1).tolist()
        sumsqs = (rows * rows).sum(dim=1).tolist()
        for r in range(rows.shape[0]):
            if abs(sums[r] - rec.sums[r]) > self.atol * cols + self.rtol * abs(rec.sums[r]):
                return f"{path}[{r}] (row sum {rec.sums[r]:.6g} vs {sums[r]:.6g})"
            # |sum(b^2 - a^2)| <= sum(|b - a| * |b + a|), with |b - a| <= atol + rtol * |a|
            bound = 2 * self.atol * math.sqrt(cols * rec.sumsqs[r]) + 2 * self.rtol * rec.sumsqs[r]
            if abs(sumsqs[r] - rec.sumsqs[r]) > bound:
                return f"{path}[{r}] (row sum of squares {rec.sumsqs[r]:.6g} vs {sumsqs[r]:.6g})"
        return None


def show(message: Any) -> str:
    """A message as indented JSON (tensors summarised)."""
    if message is None:
        return "(no message)"

    def hook(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            flat = obj.detach().cpu().reshape(-1)[:4].tolist()
            return f"tensor{tuple(obj.shape)} {str(obj.dtype)[6:]} {[round(x, 4) for x in flat]}…"
        raise NotImplementedError

    data = msgspec.to_builtins(message, enc_hook=hook, str_keys=True)
    if isinstance(message, msgspec.Struct):
        data = {"type": type(message).__name__, **data} if isinstance(data, dict) else data
    logits = getattr(message, "logits", None)
    if isinstance(data, dict) and isinstance(logits, TensorDigest):
        tops = [round(row[0], 4) if row else None for row in logits.values]
        data["logits"] = f"digest{tuple(logits.shape)} row maxima {tops}"
    return json.dumps(data, indent=1, ensure_ascii=False, default=str)
