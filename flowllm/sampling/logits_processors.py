"""Logits processors: min_tokens, logit_bias and the penalties, applied in place.

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

from flowllm.sampling.sequence_state import SeqSamplingState


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
    r, c = _flatten_rows(rows, cols, logits.shape[1], logits.device)
    logits[r, c] = float("-inf")


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
    vocab = logits.shape[1]
    c_all = torch.cat(cols)
    v_all = torch.cat(vals).to(logits.device)
    counts = torch.tensor([len(c) for c in cols])
    r_all = torch.repeat_interleave(torch.tensor(rows), counts)
    keep = (c_all >= 0) & (c_all < vocab)  # out-of-vocab ids are the validator's to reject
    r_all, c_all, v_all = r_all[keep], c_all[keep], v_all[keep.to(v_all.device)]
    r_all, c_all = r_all.to(logits.device), c_all.to(logits.device)
    logits.index_put_((r_all, c_all), v_all, accumulate=True)


def apply_penalties(logits: torch.Tensor, states: list[SeqSamplingState]) -> None:
    """Repetition, frequency and presence penalties on each row's distinct tokens."""
    rows = [i for i, s in enumerate(states) if s.history is not None and s.history.n]
    if not rows:
        return
    hists = [states[i].history for i in rows]
    lens = torch.tensor([h.n for h in hists if h is not None])
    ids = np.concatenate([h.ids[: h.n] for h in hists if h is not None])
    counts = np.concatenate([h.counts[: h.n] for h in hists if h is not None])
    dev = logits.device
    r = torch.repeat_interleave(torch.tensor(rows), lens).to(dev)  # [N]
    c = torch.from_numpy(ids).to(dev)  # [N] distinct token ids per row
    cnt = torch.from_numpy(counts).to(dev)  # [N] output counts (0: prompt only)

    def per_token(values: list[float]) -> torch.Tensor:
        return torch.repeat_interleave(torch.tensor(values, dtype=torch.float32), lens).to(dev)

    rep = per_token([states[i].params.repetition_penalty for i in rows])
    freq = per_token([states[i].params.frequency_penalty for i in rows])
    pres = per_token([states[i].params.presence_penalty for i in rows])
    if int(c.max()) >= logits.shape[1] or int(c.min()) < 0:
        keep = (c >= 0) & (c < logits.shape[1])  # ids the model cannot emit: no logit
        r, c, cnt, rep, freq, pres = (t[keep] for t in (r, c, cnt, rep, freq, pres))
    vals = logits[r, c]  # [N]
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    vals = vals - freq * cnt
    vals = vals - pres * (cnt > 0).float()
    logits[r, c] = vals


def _flatten_rows(
    rows: list[int], cols: list[torch.Tensor], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, column) pairs for per-row column lists, dropping out-of-vocab columns."""
    c = torch.cat(cols)
    r = torch.repeat_interleave(torch.tensor(rows), torch.tensor([len(x) for x in cols]))
    keep = (c >= 0) & (c < vocab)
    return r[keep].to(device), c[keep].to(device)
