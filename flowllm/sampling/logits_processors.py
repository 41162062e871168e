"""Logits processors: min_tokens, logit_bias, the penalties and grammar masks, applied
in place.

Steps 2-4 of the sampler's order (flowllm.sampling.sampler), each batched over the rows
that use it: min_tokens puts -inf on EOS and stop_token_ids while too few outputs exist;
logit_bias is added, clamped; repetition over prompt + output tokens (divide positive
logits by the penalty, multiply negative ones), then frequency (times the output count)
and presence (once per distinct output token) subtracted, these two over output tokens
only. Penalties touch only each row's distinct tokens (`TokenHistory`), never the vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from flowllm.sampling.sequence_state import SeqSamplingState, TokenHistory
from flowllm.sampling.transfer import moved, to_device


def needs_processing(states: list[SeqSamplingState], num_output_tokens: Sequence[int]) -> bool:
    """Does any row need min_tokens masking, a logit bias or a penalty this step?"""
    for i, s in enumerate(states):
        if (
            s.bias_ids is not None
            or (s.history is not None and s.history.n)
            or (num_output_tokens[i] < s.params.min_tokens and s.min_tokens_ids.numel())
        ):
            return True
    return False


def apply_processors(
    logits: torch.Tensor, states: list[SeqSamplingState], num_output_tokens: Sequence[int]
) -> None:
    """min_tokens, logit_bias, then the penalties, on `logits` [B, V] (row i: states[i])."""
    mask_min_tokens(logits, states, num_output_tokens)
    apply_logit_bias(logits, states)
    apply_penalties(logits, states)


def mask_min_tokens(
    logits: torch.Tensor, states: list[SeqSamplingState], num_output_tokens: Sequence[int]
) -> None:
    """-inf on EOS and stop_token_ids for rows with fewer than min_tokens outputs."""
    rows: list[int] = []
    cols: list[torch.Tensor] = []
    for i, s in enumerate(states):
        if num_output_tokens[i] < s.params.min_tokens and s.min_tokens_ids.numel():
            rows.append(i)
            cols.append(s.min_tokens_ids)
    if not rows:
        return
    r, c, _ = _flatten_rows(rows, cols, logits.shape[1])
    dev = logits.device
    logits[moved(r, dev), moved(c, dev)] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, states: list[SeqSamplingState]) -> None:
    """Add each row's clamped logit_bias (out-of-vocab ids skipped)."""
    rows: list[int] = []
    cols: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    for i, s in enumerate(states):
        if s.bias_ids is not None and s.bias_values is not None:
            rows.append(i)
            cols.append(s.bias_ids)
            vals.append(s.bias_values)
    if not rows:
        return
    v = torch.cat(vals)
    r, c, keep = _flatten_rows(rows, cols, logits.shape[1])
    if keep is not None:
        v = v[keep]
    dev = logits.device
    logits.index_put_((moved(r, dev), moved(c, dev)), moved(v, dev), accumulate=True)


def apply_penalties(logits: torch.Tensor, states: list[SeqSamplingState]) -> None:
    """Repetition, frequency and presence penalties on each row's distinct tokens."""
    hists: list[TokenHistory] = []
    rows: list[int] = []
    for i, s in enumerate(states):
        if s.history is not None and s.history.n:
            rows.append(i)
            hists.append(s.history)
    if not rows:
        return
    lens = np.array([h.n for h in hists])
    params = [states[i].params for i in rows]

    def per_token(values: list[float]) -> np.ndarray:
        return np.repeat(np.array(values, dtype=np.float32), lens)

    columns = [
        np.repeat(np.array(rows), lens),  # row of each (row, token) pair
        np.concatenate([h.ids[: h.n] for h in hists]),  # distinct token ids per row
        np.concatenate([h.counts[: h.n] for h in hists]),  # output counts (0: prompt only)
        per_token([p.repetition_penalty for p in params]),
        per_token([p.frequency_penalty for p in params]),
        per_token([p.presence_penalty for p in params]),
    ]
    ids = columns[1]
    if ids.max() >= logits.shape[1] or ids.min() < 0:
        keep = (ids >= 0) & (ids < logits.shape[1])  # ids the model cannot emit: no logit
        columns = [a[keep] for a in columns]
    dev = logits.device
    r, c, cnt, rep, freq, pres = (moved(torch.from_numpy(a), dev) for a in columns)
    vals = logits[r, c]  # [N]
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    vals = vals - freq * cnt
    vals = vals - pres * (cnt > 0).float()
    logits[r, c] = vals


def _flatten_rows(
    rows: list[int], cols: list[torch.Tensor], vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(row index, column) pairs, on the host, for per-row column lists, without the
    out-of-vocab columns; and the mask that dropped them (None when none was)."""
    c = torch.cat(cols)
    r = torch.repeat_interleave(torch.tensor(rows), torch.tensor([len(x) for x in cols]))
    keep = (c >= 0) & (c < vocab)
    if bool(keep.all()):
        return r, c, None
    return r[keep], c[keep], keep


_NEG_INF_BITS = np.uint32(0xFF800000)  # float32 -inf


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """A grammar's mask (flowllm.sampling.grammar): -inf on the logits of `rows` (one
    packed bitmask row each, in order) whose bit is clear.

    The bits are unpacked by numpy (little-endian words: bit j of word w is token 32w + j)
    into an additive bias of 0.0 or -inf, made from -inf's float32 bit pattern without a
    branch: a masked fill branches on every token, and grammar masks mispredict often
    (benchmarks/README.md, "Structured outputs").
    """
    vocab = logits.shape[1]
    words = bitmask.numpy().astype("<i4", copy=False).view(np.uint8)
    bits = np.unpackbits(words, axis=1, bitorder="little")[:, :vocab]  # [R, V] 0/1
    blocked = (1 - bits).astype(np.uint32) * _NEG_INF_BITS  # 0 or -inf's bit pattern
    bias = moved(torch.from_numpy(blocked.view(np.float32)), logits.device)
    logits.index_add_(0, to_device(rows, torch.int64, logits.device), bias)
