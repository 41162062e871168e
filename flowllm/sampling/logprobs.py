"""Logprobs: of each sampled token (rank and top-N alternatives), and of prompt tokens.

The numbers are computed on the logits' device as one float64 table, a row per token
(`logprob_columns`), so that a step brings them to the host in the one copy that brings its
tokens; `logprob_entries` turns the copied rows into `TokenLogprobs`.
"""

from __future__ import annotations

import torch

from flowllm.messages import TokenLogprobs
from flowllm.sampling.transfer import to_device


def logprob_columns(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int, scratch: torch.Tensor
) -> torch.Tensor:
    """[R, 2 + 2k] float64: row i holds token_ids[i]'s logprob, its rank, then the k top
    logprobs and their ids (float64 holds ids and ranks exactly).

    logprobs: [R, V] log_softmax; token_ids: [R] int64 on its device; scratch: [R, V]
    float32 to overwrite. rank = 1 + the number of tokens strictly more likely.
    """
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    torch.gt(logprobs, chosen, out=scratch)  # 1.0 where strictly more likely
    ranks = scratch.sum(dim=-1, keepdim=True) + 1  # [R, 1], exact below 2**24
    parts = [chosen, ranks]
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)
        parts += [values, indices]
    return torch.cat([p.double() for p in parts], dim=1)


def logprob_entries(
    token_ids: list[int], rows: list[list[float]], top_ns: list[int], k: int
) -> list[TokenLogprobs]:
    """TokenLogprobs of token_ids[i] with its top_ns[i] alternatives (at most k), from row i
    of a `logprob_columns` table (as a list) with k top entries."""
    out = []
    for t, row, n in zip(token_ids, rows, top_ns, strict=True):
        n = min(n, k)
        ids, values = row[2 + k : 2 + k + n], row[2 : 2 + n]
        top = tuple(zip(map(int, ids), values, strict=True))
        out.append(TokenLogprobs(token_id=t, logprob=row[0], rank=int(row[1]), top=top))
    return out


def token_logprobs(
    logprobs: torch.Tensor, token_ids: list[int], top_ns: list[int], scratch: torch.Tensor
) -> list[TokenLogprobs]:
    """TokenLogprobs for row i's token_ids[i] and its top_ns[i] alternatives.

    logprobs: [R, V] log_softmax; scratch: [R, V] float32 to overwrite.
    """
    k = min(max(top_ns), logprobs.shape[1])
    ids = to_device(token_ids, torch.int64, logprobs.device)
    rows = logprob_columns(logprobs, ids, k, scratch).tolist()
    return logprob_entries(token_ids, rows, top_ns, k)


def prompt_logprobs(
    prompt: tuple[int, ...], top_n: int, num_computed_tokens: int, logits: torch.Tensor
) -> tuple[TokenLogprobs | None, ...]:
    """Logprobs of the prompt tokens that a prefill chunk's logits predict.

    logits: [T, V], row t computed at position num_computed_tokens + t, so it predicts
    prompt token num_computed_tokens + t + 1; rows past the prompt are ignored. The
    chunk at position 0 starts with None (nothing predicts the first token), so the
    chunks of one prompt concatenate to exactly one entry per prompt token.
    """
    first: tuple[TokenLogprobs | None, ...] = (None,) if num_computed_tokens == 0 else ()
    n = max(0, min(logits.shape[0], len(prompt) - 1 - num_computed_tokens))
    if n == 0:
        return first
    lp = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, V]
    targets = list(prompt[num_computed_tokens + 1 : num_computed_tokens + 1 + n])
    return first + tuple(token_logprobs(lp, targets, [top_n] * n, torch.empty_like(lp)))
