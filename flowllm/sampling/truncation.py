"""Truncating a batch of distributions: min_p's floor, top_k and top_p, in place.

Each keeps its rows summing to what survives (no renormalizing: the inverse-CDF draw
scales by each row's mass). On the CPU top_p finds each row's threshold without sorting the
row (`top_p_threshold`), except for small vocabularies, where a full sort is cheaper; on
other devices by a sort (`sorted_threshold`), which needs no value on the host.
"""

from __future__ import annotations

import torch

from flowllm.sampling.inverse_cdf import block_sums
from flowllm.sampling.transfer import to_device

_RADIX_CHUNK = 1 << 21  # top_p: values per thresholding chunk (keeps temporaries small)
_SORT_VOCAB = 4096  # top_p: up to this vocabulary size a full sort is the cheaper way


def select_rows(probs: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the rows to filter, their index): probs itself (index None) when rows are all rows."""
    if len(rows) == probs.shape[0]:
        return probs, None
    idx = to_device(rows, torch.int64, probs.device)
    return probs.index_select(0, idx), idx


def zero_below(x: torch.Tensor, floor: torch.Tensor, scratch: torch.Tensor) -> None:
    """x[i, j] = 0 where x[i, j] < floor[i]; x >= 0 and finite, scratch shaped like x.

    A multiply by a 0/1 float mask: several times faster on CPU than masked_fill_.
    """
    torch.ge(x, floor, out=scratch)
    x.mul_(scratch)


def keep_top_k(
    probs: torch.Tensor, rows: list[int], ks: list[int], scratch: torch.Tensor | None = None
) -> None:
    """Zero all but each row's k largest probabilities (ties with the k-th kept).

    scratch: [len(rows), V] float32 to overwrite (allocated when None).
    """
    sub, idx = select_rows(probs, rows)  # [Rk, V]
    top = sub.topk(max(ks), dim=-1).values  # [Rk, kmax], descending
    kth = top.gather(1, to_device(ks, torch.int64, probs.device).unsqueeze(1) - 1)  # [Rk, 1]
    zero_below(sub, kth, torch.empty_like(sub) if scratch is None else scratch)
    if idx is not None:
        probs.index_copy_(0, idx, sub)


def keep_top_p(
    probs: torch.Tensor, rows: list[int], ps: list[float], scratch: torch.Tensor | None = None
) -> None:
    """Keep each row's smallest top set with mass >= p × row mass (ties with its last kept).

    scratch: [len(rows), V] float32 to overwrite (allocated when None). The threshold (the
    value of the last token kept) comes from `top_p_threshold` on the CPU, without sorting
    the row, and from `sorted_threshold` elsewhere.
    """
    dev = probs.device
    sub, idx = select_rows(probs, rows)  # [Rp, V]
    target = block_sums(sub).sum(dim=-1) * to_device(ps, torch.float32, dev)
    if sub.shape[1] <= _SORT_VOCAB or not sub.is_cpu:
        threshold = sorted_threshold(sub, target)  # [Rp]
    else:
        # chunks of ~2M values keep the int64 bucket ids under glibc's mmap threshold
        step = max(1, min(1024, _RADIX_CHUNK // sub.shape[1]))
        threshold = torch.cat(
            [
                top_p_threshold(sub[i : i + step], target[i : i + step])
                for i in range(0, len(rows), step)
            ]
        )  # [Rp]
    zero_below(sub, threshold.unsqueeze(1), torch.empty_like(sub) if scratch is None else scratch)
    if idx is not None:
        probs.index_copy_(0, idx, sub)


def sorted_threshold(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`top_p_threshold` by a full sort: cheaper than bucketing for small vocabularies."""
    values = probs.sort(dim=1, descending=True).values  # [P, V]
    m = torch.searchsorted(values.cumsum(dim=1), target.unsqueeze(1).contiguous())
    return values.gather(1, m.clamp_(max=probs.shape[1] - 1)).squeeze(1)


def top_p_threshold(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The largest value t of each row such that the mass of the values >= t reaches target.

    probs: [P, V] >= 0; target: [P]. Equal to reading the threshold off a descending sort
    and its prefix sums (up to float rounding of the sums), without sorting the row:
    non-negative floats order like their int32 bit patterns, so the top 11 bits (exponent
    and 3 mantissa bits: buckets of 1/8 octave) bucket the values in one pass; the bucket
    where the running mass from the top reaches the target is the only one that needs
    sorting, and it is small. Its size is read on the host, so it serves CPU tensors.
    """
    rows = probs.shape[0]
    dev = probs.device
    nb = 2048  # bucket = bits >> 20 for any non-negative float32
    bucket = (probs.view(torch.int32) >> 20).long()  # [P, V]
    mass = torch.zeros(rows, nb, dtype=torch.float32, device=dev)
    mass.scatter_add_(1, bucket, probs)  # [P, nb]
    at_or_above = mass.flip(1).cumsum(1).flip(1)  # [P, nb] mass of buckets >= b
    b = torch.arange(nb, device=dev)
    ok = (mass > 0) & (at_or_above >= target.unsqueeze(1))
    last_ok = torch.where(ok, b, -1).amax(dim=1, keepdim=True)  # [P, 1]
    first_nonempty = torch.where(mass > 0, b, nb - 1).amin(dim=1, keepdim=True)
    chosen = torch.where(last_ok >= 0, last_ok, first_nonempty)  # [P, 1] crossing bucket
    above = torch.where(
        chosen + 1 < nb, at_or_above.gather(1, (chosen + 1).clamp(max=nb - 1)), 0.0
    )  # [P, 1] mass of the buckets above it
    # The crossing bucket's values, one padded row each, sorted descending.
    r, j = (bucket == chosen).nonzero(as_tuple=True)  # row-major: r ascending
    counts = torch.bincount(r, minlength=rows)  # [P] >= 1
    starts = counts.cumsum(0) - counts
    pos = torch.arange(r.numel(), device=dev) - starts[r]
    cand = torch.zeros(rows, int(counts.max()), dtype=torch.float32, device=dev)
    cand[r, pos] = probs[r, j]
    cand = cand.sort(dim=1, descending=True).values  # [P, K]
    cum = cand.cumsum(dim=1) + above  # [P, K] mass of everything >= cand[:, k]
    m = torch.searchsorted(cum, target.unsqueeze(1).contiguous())  # first k reaching target
    m = torch.minimum(m, (counts - 1).unsqueeze(1))
    return cand.gather(1, m).squeeze(1)
