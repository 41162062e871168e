"""The torch reference paged attention against a plain per-query loop over dense K/V."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from attention_cases import expected, make_case, rows_alone

from flowllm import kernels
from flowllm.kernels import reference
from flowllm.kernels.reference import KernelInputError
from flowllm.kernels.workspace import Workspace


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "heads", "kv_heads"),
    [
        ([1, 1, 1], [5, 17, 9], 4, 4),  # decode only, ragged lengths
        ([1, 1, 1, 1], [4, 8, 1, 13], 6, 2),  # decode with GQA, block-aligned lengths
        ([7], [7], 4, 2),  # one prefill, no cached prefix
        ([5, 1, 9, 1], [12, 30, 9, 3], 8, 2),  # prefills (one after a prefix) mixed w/ decodes
        ([3, 2], [3, 11], 2, 1),  # MQA, prefill chunk after a cached prefix
    ],
)
def test_reference_matches_naive(q_lens, seq_lens, heads, kv_heads) -> None:
    case = make_case(q_lens, seq_lens, heads, kv_heads)
    scale = 1 / math.sqrt(16) * 0.9  # a non-default scale is honoured
    got = reference.paged_attention(*case, scale, max(q_lens), max(seq_lens))
    torch.testing.assert_close(got, expected(*case, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (1, 0.0), (0, 2.0), (7, 1.5)])
def test_window_and_softcap_match_naive(window: int, softcap: float) -> None:
    """A sliding window (shorter and longer than a block, and 1: the query alone) and a
    score cap, on decode rows and a prefill chunk after a cached prefix: each row sees its
    last `window` positions only, scores capped before the softmax."""
    case = make_case([1, 9, 1, 3], [30, 12, 4, 21], 6, 2, seed=2)
    got = reference.paged_attention(*case, 0.7, 9, 30, window=window, softcap=softcap)
    torch.testing.assert_close(got, expected(*case, 0.7, window, softcap), atol=1e-5, rtol=1e-5)
    if window:  # keys before the window never count, whatever they hold
        _, k_cache, v_cache, tables, _, _ = case
        k_cache[tables[0, 0].long()] = 1e4
        v_cache[tables[0, 0].long()] = float("nan")
        again = reference.paged_attention(*case, 0.7, 9, 30, window=window, softcap=softcap)
        assert torch.equal(again[0], got[0])


def test_reference_bf16_close_to_fp32() -> None:
    case32 = make_case([4, 1, 1], [10, 6, 20], 4, 2)
    case16 = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in case32)
    got = reference.paged_attention(*case16, 0.25, 4, 20)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected(*case32, 0.25), atol=3e-2, rtol=3e-2)


def test_stale_slots_past_seq_len_are_ignored() -> None:
    """Slots after a sequence's length (reused blocks, padding) never leak into its output."""
    query, k_cache, v_cache, tables, qsl, seq_lens = make_case([1, 2], [6, 7], 4, 2)
    before = reference.paged_attention(query, k_cache, v_cache, tables, qsl, seq_lens, 0.3, 2, 7)
    for i, s in enumerate(seq_lens.tolist()):
        last = tables[i, (s - 1) // 4].long()
        k_cache[last, (s - 1) % 4 + 1 :] = 1e4
        v_cache[last, (s - 1) % 4 + 1 :] = -1e4
    after = reference.paged_attention(query, k_cache, v_cache, tables, qsl, seq_lens, 0.3, 2, 7)
    torch.testing.assert_close(after, before)


def test_store_kv_writes_slots() -> None:
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([13, 2, 7])  # block 3 offset 1, block 0 offset 2, block 1 offset 3
    kernels.store_kv(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache[3, 1], key[0])
    torch.testing.assert_close(k_cache[0, 2], key[1])
    torch.testing.assert_close(v_cache[1, 3], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3


def test_dispatch_picks_reference_on_cpu() -> None:
    """On CPU the reference serves, its decode rows taken by the native kernel where the
    library loads; either way the dispatcher agrees with the reference."""
    assert kernels.implementation_for(torch.device("cpu")) is reference
    case = make_case([2, 1], [5, 3], 2, 2)
    torch.testing.assert_close(
        kernels.paged_attention(*case, 0.5, 2, 5), reference.paged_attention(*case, 0.5, 2, 5)
    )


def test_cuda_without_triton_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton is an extra (`flowllm[cuda]`): a CPU install runs without it, and CUDA
    attention without it is one clear error."""
    monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "flowllm.kernels.triton_attention", raising=False)
    assert kernels.implementation_for(torch.device("cpu")) is reference
    with pytest.raises(RuntimeError, match=r"pip install 'flowllm\[cuda\]'"):
        kernels.implementation_for(torch.device("cuda"))


def test_bad_shapes_raise_typed_errors() -> None:
    query, k_cache, v_cache, tables, qsl, seq_lens = make_case([1], [3], 3, 3)
    with pytest.raises(KernelInputError, match="multiple"):
        reference.paged_attention(
            query, k_cache[:, :, :2], v_cache[:, :, :2], tables, qsl, seq_lens, 1.0, 1, 3
        )
    with pytest.raises(KernelInputError, match="needs 1 blocks"):
        reference.paged_attention(query, k_cache, v_cache, tables[:, :0], qsl, seq_lens, 1.0, 1, 3)
    with pytest.raises(KernelInputError, match="slot_mapping"):
        reference.store_kv(query, query, k_cache, v_cache, torch.tensor([0, 1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (3, 1)])
def test_half_precision_decode_close_to_exact(dtype, heads, kv_heads) -> None:
    """The half-precision decode path (block-diagonal products) against the float64 loop."""
    case32 = make_case([1, 1, 1, 1, 6], [5, 33, 16, 2, 6], heads, kv_heads, block_size=8, seed=3)
    case = tuple(t.to(dtype) if t.is_floating_point() else t for t in case32)
    got = reference.paged_attention(*case, 0.25, 6, 33)
    assert got.dtype == dtype
    # inputs rounded to `dtype` first, so only the kernel's own rounding is measured
    exact = expected(*(t.double() if t.is_floating_point() else t for t in case), 0.25)
    torch.testing.assert_close(got.double(), exact, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_attends_as_if_alone(dtype) -> None:
    """Batch invariance: the rows of a step (decode rows of ragged lengths, a long prefill
    chunk after a cached prefix) equal each row attended alone as a decode query."""
    case = make_case([1, 37, 1, 1], [40, 48, 3, 64], 6, 2, block_size=4, seed=5)
    case = tuple(t.to(dtype) if t.is_floating_point() else t for t in case)
    got = reference.paged_attention(*case, 0.3, 37, 64)
    assert torch.equal(got, rows_alone(case, 0.3, reference.paged_attention))


def test_workspace_reused_across_calls_and_shapes() -> None:
    """One workspace serves calls of different sizes and dtypes; outputs never alias it."""
    ws = Workspace()
    big = make_case([1] * 5, [30, 12, 47, 8, 19], 4, 2, seed=7)
    small = make_case([2, 1], [9, 4], 4, 4, seed=8)
    half = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in big)
    first = reference.paged_attention(*big, 0.25, 1, 47, workspace=ws)
    kept = first.clone()
    held = ws.nbytes()
    for case, q_len, max_len in ((small, 2, 9), (half, 1, 47), (big, 1, 47)):
        got = reference.paged_attention(*case, 0.25, q_len, max_len, workspace=ws)
        fresh = reference.paged_attention(*case, 0.25, q_len, max_len)
        torch.testing.assert_close(got, fresh, atol=0, rtol=0)
    assert torch.equal(first, kept)
    assert ws.nbytes() >= held > 0


def test_workspace_grows_and_keeps_its_buffer() -> None:
    ws = Workspace()
    a = ws.get("x", (4, 8), torch.float32, torch.device("cpu"))
    b = ws.get("x", (2, 8), torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr()  # a smaller request reuses the buffer
    c = ws.get("x", (64, 8), torch.float32, torch.device("cpu"))
    assert c.shape == (64, 8) and ws.get("x", (64, 8), torch.float32, c.device).data_ptr() == (
        c.data_ptr()
    )
    d = ws.get("x", (64, 8), torch.bfloat16, torch.device("cpu"))
    assert d.dtype == torch.bfloat16
