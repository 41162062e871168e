"""The draw: one token per row by inverse CDF, with sums in fixed 256-token blocks.

Summing in fixed blocks, serially within each, rounds the same whatever the batch, so a
seeded row draws the same token alone or inside any batch.
"""

from __future__ import annotations

import torch

CDF_BLOCK = 256  # block size of the two-level search


def block_sums(x: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R, ceil(V / 256)]: sums of consecutive 256-token blocks.

    Each block is summed serially whatever R is; a plain row sum would be split across
    threads when R = 1 and rounded differently than inside a batch.
    """
    rows, vocab = x.shape
    nb = vocab // CDF_BLOCK
    parts = []
    if nb:
        parts.append(x[:, : nb * CDF_BLOCK].reshape(rows, nb, CDF_BLOCK).sum(dim=-1))
    if vocab % CDF_BLOCK:
        parts.append(x[:, nb * CDF_BLOCK :].sum(dim=-1, keepdim=True))
    return torch.cat(parts, dim=1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one index per row with probability proportional to `probs` (rows need mass > 0).

    Two levels so the cost is one summing pass: block sums of 256 tokens locate the block
    holding u × mass, then a cumsum inside that block alone locates the token. A token of
    zero probability is never returned, whatever the rounding.
    probs: [R, V] >= 0; u: [R] in [0, 1). Returns [R] int64.
    """
    vocab = probs.shape[1]
    block_cdf = block_sums(probs).cumsum(dim=-1)  # [R, NB]
    total = block_cdf[:, -1:].contiguous()  # [R, 1]
    x = u.unsqueeze(1) * total  # [R, 1]
    b = torch.minimum(
        torch.searchsorted(block_cdf, x, right=True),  # first block whose cdf exceeds x
        torch.searchsorted(block_cdf, total),  # last block with mass (rounding guard)
    )  # [R, 1]
    before = torch.where(
        b > 0, block_cdf.gather(1, (b - 1).clamp_(min=0)), torch.zeros_like(x)
    )  # [R, 1]
    residual = (x - before).clamp_(min=0.0)
    cols = b * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)  # [R, BLOCK]
    inside = probs.gather(1, cols.clamp(max=vocab - 1))
    inside.masked_fill_(cols >= vocab, 0.0)
    inner_cdf = inside.cumsum(dim=-1)  # [R, BLOCK]
    j = torch.minimum(
        torch.searchsorted(inner_cdf, residual, right=True),
        torch.searchsorted(inner_cdf, inner_cdf[:, -1:].contiguous()),  # last token with mass
    )
    # the clamp only matters for rows without finite mass (NaN logits): stay a valid id
    return (b * CDF_BLOCK + j).squeeze(1).clamp_(0, vocab - 1)
