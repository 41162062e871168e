"""Logprobs: of each sampled token (rank and top-N alternatives), and of prompt tokens."""

from __future__ import annotations

import torch

from flowllm.messages import TokenLogprobs


def token_logprobs(
    logprobs: torch.Tensor, token_ids: list[int], top_ns: list[int], scratch: torch.Tensor
) -> list[TokenLogprobs]:
    """TokenLogprobs for row i's token_ids[i] and its top_ns[i] alternatives.

    logprobs: [R, V] log_softmax; scratch: [R, V] float32 to overwrite.
    rank = 1 + the number of tokens strictly more likely.
    """
    dev = logprobs.device
    tok = torch.tensor(token_ids, dtype=torch.int64, device=dev).unsqueeze(1)  # [R, 1]
    chosen = logprobs.gather(1, tok)  # [R, 1]
    torch.gt(logprobs, chosen, out=scratch)  # 1.0 where strictly more likely
    ranks = (scratch.sum(dim=-1) + 1).long().tolist()
    chosen_list = chosen.squeeze(1).tolist()
    k = min(max(top_ns), logprobs.shape[1])
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)
        top_vals, top_ids = values.tolist(), indices.tolist()
    out = []
    for i, (t, lp, rank, n) in enumerate(zip(token_ids, chosen_list, ranks, top_ns, strict=True)):
        top = tuple(zip(top_ids[i][:n], top_vals[i][:n], strict=True)) if n > 0 else ()
        out.append(TokenLogprobs(token_id=t, logprob=lp, rank=rank, top=top))
    return out


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
