"""The native decode attention and K/V store (`flowllm.kernels.cpu_attention`) against the
torch reference and a float64 oracle, and the checks of its wrapper."""

from __future__ import annotations

import pytest
import torch
from attention_cases import expected, make_case, rows_alone

from flowllm import kernels
from flowllm.kernels import cpu_attention, reference
from flowllm.kernels.reference import KernelInputError

pytestmark = pytest.mark.usefixtures("native_build")  # each build in turn

SCALE = 0.2


def as_dtype(case: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in case)


def exact(case: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The float64 oracle on the case's own (possibly bf16-rounded) inputs."""
    return expected(*as_dtype(case, torch.float64), SCALE)


def close(got: torch.Tensor, case: tuple[torch.Tensor, ...]) -> None:
    """fp32 to float32 rounding; bf16 within one bf16 rounding of the output."""
    want = exact(case)
    # bf16 rounds to nearest: half an ulp, 2^-8 of the value at most (float32 sums aside)
    rtol = 2e-6 if got.dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (12, 12, 64), (8, 2, 64), (12, 2, 96), (2, 1, 32), (4, 2, 80), (2, 1, 16)],
)
def test_decode_matches_oracle_and_reference(dtype, block_size, heads, kv_heads, head_dim):
    """Odd lengths (1, a block's end, past it, several blocks), block ids permuted; head
    sizes in 1-6 registers, and bf16 ones not in whole registers left to the reference."""
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 5, 77]
    case = as_dtype(
        make_case([1] * 5, seq_lens, heads, kv_heads, head_dim, block_size, seed=block_size),
        dtype,
    )
    query, k_cache, v_cache, tables, _, lens = case
    if head_dim % cpu_attention.HEAD_DIM_MULTIPLE[dtype]:
        assert not cpu_attention.serves(query, k_cache)
        got = kernels.paged_attention(*case, SCALE, 1, max(seq_lens))
        assert torch.equal(got, reference.paged_attention(*case, SCALE, 1, max(seq_lens)))
        return
    out = torch.empty_like(query)
    cpu_attention.decode_attention(query, k_cache, v_cache, tables, lens, SCALE, out)
    close(out, case)
    ref = reference.paged_attention(*case, SCALE, 1, max(seq_lens))
    tol = 2e-6 if dtype == torch.float32 else 2e-2  # the reference rounds bf16 scores
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_prefill_and_decode_step(dtype):
    """Every row of a mixed step (prefill chunks, one after a cached prefix, and decode rows)
    by the kernel, through the dispatcher: each equals the same row attended alone as a
    decode query (batch invariance), and the float64 oracle within rounding."""
    q_lens, seq_lens = [5, 1, 9, 1, 1], [12, 30, 9, 3, 41]
    case = as_dtype(make_case(q_lens, seq_lens, 9, 3, 64, 16, seed=1), dtype)
    assert cpu_attention.serves(case[0], case[1])
    got = kernels.paged_attention(*case, SCALE, max(q_lens), max(seq_lens))
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, rows_alone(case, SCALE, kernels.paged_attention))
    close(got, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_of_one_sequence_read_its_keys_together_and_exactly(dtype):
    """Decode rows at a sequence's successive positions (drafts being verified, each row
    with its own copy of the block table) are attended in one walk over its keys, up to 8
    rows a walk; each row equals the row alone and the float64 oracle. A row of another
    sequence whose table shares the first block but not the rest, at the next position,
    gets its own keys."""
    bs, base = 16, 40
    prefill = make_case([11], [base + 10], 9, 3, 64, bs, seed=3)
    query, k_cache, v_cache, table, _, _ = as_dtype(prefill, dtype)
    shared = table.clone()
    shared[0, 1:] = torch.tensor([int(b) for b in range(k_cache.shape[0])
                                  if b not in table[0].tolist()][: table.shape[1] - 1])  # fmt: skip
    lens = [base + j for j in range(10)] + [base + 10]
    tables = torch.cat([table.expand(10, -1), shared])
    one = torch.arange(12, dtype=torch.int32)
    case = (query, k_cache, v_cache, tables, one, torch.tensor(lens, dtype=torch.int32))
    out = torch.empty_like(query)
    cpu_attention.decode_attention(query, k_cache, v_cache, tables, case[-1], SCALE, out)
    assert torch.equal(out, rows_alone(case, SCALE, kernels.paged_attention))
    close(out, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(20, 0.0), (1, 0.0), (0, 3.0), (9, 2.5)])
def test_window_and_softcap(dtype, window, softcap):
    """A sliding window (starting inside a block, past several, and the query alone) and a
    score cap: decode rows and a mixed step through the dispatcher equal the float64 oracle
    and each row attended alone; keys before the window are never read."""
    q_lens, seq_lens = [1, 7, 1, 1], [41, 30, 5, 64]
    case = as_dtype(make_case(q_lens, seq_lens, 8, 2, 64, 16, seed=6), dtype)
    options = {"window": window, "softcap": softcap}
    got = kernels.paged_attention(*case, SCALE, max(q_lens), max(seq_lens), **options)
    assert torch.equal(got, rows_alone(case, SCALE, kernels.paged_attention, **options))
    want = expected(*as_dtype(case, torch.float64), SCALE, window, softcap)
    rtol = 2e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=rtol)
    ref = reference.paged_attention(*case, SCALE, max(q_lens), max(seq_lens), **options)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    if window:  # sequence 0's first block (positions 0-15) is before its query's window
        _, k_cache, v_cache, tables, _, _ = case
        k_cache[tables[0, 0].long()] = float("nan")
        v_cache[tables[0, 0].long()] = float("nan")
        again = kernels.paged_attention(*case, SCALE, max(q_lens), max(seq_lens), **options)
        assert torch.equal(again[0], got[0])


def test_strided_query_rows_and_stale_slots():
    """A query taken from a fused qkv row (token stride 3 H D) reads right; slots past a
    sequence's length never leak in."""
    query, k_cache, v_cache, tables, _, lens = make_case([1, 1], [6, 19], 4, 2, 32, 8)
    qkv = torch.randn(2, 3, 4, 32)
    qkv[:, 0] = query
    strided = qkv.unbind(1)[0]
    assert strided.stride(0) == 3 * 4 * 32
    out = torch.empty_like(query)
    cpu_attention.decode_attention(strided, k_cache, v_cache, tables, lens, SCALE, out)
    for i, s in enumerate(lens.tolist()):
        last = tables[i, (s - 1) // 8].long()
        k_cache[last, (s - 1) % 8 + 1 :] = 1e4
        v_cache[last, (s - 1) % 8 + 1 :] = float("nan")
    again = torch.empty_like(query)
    cpu_attention.decode_attention(strided, k_cache, v_cache, tables, lens, SCALE, again)
    assert torch.equal(out, again)


def test_threads_agree_with_one_thread():
    case = make_case([1] * 6, [40, 3, 64, 17, 1, 90], 12, 4, 64, 16, seed=4)
    query, k_cache, v_cache, tables, _, lens = case
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.empty_like(query)
            cpu_attention.decode_attention(query, k_cache, v_cache, tables, lens, SCALE, out)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])  # each (sequence, kv head) is summed by one thread


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_slots_like_the_reference(dtype):
    k_cache = torch.zeros(6, 4, 3, 16, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.randn(5, 2, 3, 16).to(dtype)  # a fused [k | v] row per token
    key, value = kv.unbind(1)
    slots = torch.tensor([13, 2, 7, 23, 0])
    cpu_attention.store_kv(key, value, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.store_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_wrapper_rejects_bad_inputs():
    query, k_cache, v_cache, tables, _, lens = make_case([1, 1], [5, 9], 4, 2, 16, 4)
    out = torch.empty_like(query)

    def attend(**changes):
        args = {"query": query, "k_cache": k_cache, "v_cache": v_cache,
                "block_tables": tables, "seq_lens": lens, "scale": SCALE, "out": out}  # fmt: skip
        cpu_attention.decode_attention(**{**args, **changes})

    cases = [
        ({"query": query.transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous"),
        ({"query": query.double()}, "query must be Float, got Double"),
        ({"k_cache": k_cache.to(torch.bfloat16)}, "v_cache must be BFloat16, got Float"),
        ({"k_cache": k_cache[:, :, :, :8], "v_cache": v_cache[:, :, :, :8]}, "contiguous"),
        ({"block_tables": tables.long()}, "block_tables"),
        ({"block_tables": tables[:1]}, "rows"),
        ({"seq_lens": lens.long()}, "seq_lens"),
        ({"seq_lens": torch.tensor([5, 4 * tables.shape[1] + 1], dtype=torch.int32)}, "seq_len"),
        ({"seq_lens": torch.tensor([0, 9], dtype=torch.int32)}, "seq_len 0"),
        ({"block_tables": tables.clone().fill_(k_cache.shape[0])}, "outside the cache"),
        ({"seqs": torch.tensor([0, 2]), "rows": torch.tensor([0, 1])}, "out of range"),
        ({"seqs": torch.tensor([0, 1]), "rows": torch.tensor([0, 5])}, "out of range"),
        ({"seqs": torch.tensor([0, 1])}, "together"),
    ]
    for changes, message in cases:
        with pytest.raises(KernelInputError, match=message):
            attend(**changes)
    for head_dim, dtype, multiple in ((8, torch.float32, 16), (16, torch.bfloat16, 32)):
        small = as_dtype(make_case([1], [5], 2, 2, head_dim, 4), dtype)
        q, k, v, t, _, n = small
        with pytest.raises(KernelInputError, match=f"multiple of {multiple}"):
            cpu_attention.decode_attention(q, k, v, t, n, SCALE, torch.empty_like(q))
    key = torch.randn(2, 2, 16)
    with pytest.raises(KernelInputError, match="outside the cache"):
        cpu_attention.store_kv(key, key, k_cache, v_cache, torch.tensor([0, k_cache.shape[0] * 4]))
    with pytest.raises(KernelInputError, match="slot_mapping"):
        cpu_attention.store_kv(key, key, k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="do not match"):
        cpu_attention.store_kv(key.double(), key.double(), k_cache, v_cache, torch.tensor([0, 1]))
