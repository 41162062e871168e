"""Block pool and KV cache manager: exact block ids, reference counts, free/eviction order,
and a hypothesis state machine checking the pool against a plain-list model of itself."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flowllm.scheduling.block_pool import (
    NO_PARENT,
    BlockPool,
    BlockPoolError,
    hash_block,
    hash_blocks,
    salt_root,
)
from flowllm.scheduling.kv_cache_manager import KVCacheManager


def reference_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Independent oracle: sha256 over parent digest + little-endian int64 token ids."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


# ---------------------------------------------------------------------------- hashing


def test_hash_block_matches_reference_and_chains() -> None:
    tokens = list(range(100, 132))
    h0 = hash_block(NO_PARENT, tokens[:16])
    h1 = hash_block(h0, tokens[16:])
    assert h0 == reference_hash(b"", tokens[:16])
    assert h1 == reference_hash(h0, tokens[16:])
    assert hash_blocks(tokens, 16, 0, NO_PARENT, 2) == [h0, h1]
    assert hash_blocks(tokens, 16, 1, h0, 2) == [h1]
    # Same block tokens after a different prefix hash differently.
    assert hash_block(hash_block(NO_PARENT, [7] * 16), tokens[16:]) != h1


# ---------------------------------------------------------------------------- pool basics


def test_allocate_hands_out_head_first_with_count_one() -> None:
    pool = BlockPool(8)
    assert pool.free_queue() == list(range(8))
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.ref_cnt(b) for b in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert pool.free_queue() == [3, 4, 5, 6, 7]
    assert pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(3 / 8)


def test_allocate_short_returns_none_and_changes_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.free_queue() == [3]
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []


def test_free_appends_tail_blocks_first() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)  # [0, 1, 2]
    b = pool.allocate(2)  # [3, 4]
    pool.free(b)
    assert pool.free_queue() == [5, 4, 3]
    pool.free(a)
    assert pool.free_queue() == [5, 4, 3, 2, 1, 0]
    # Least recently freed first, and within a sequence tail before head.
    assert pool.allocate(6) == [5, 4, 3, 2, 1, 0]


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.free(blocks)
    with pytest.raises(BlockPoolError):
        pool.free(blocks)


def test_shared_block_returns_to_queue_only_after_last_holder() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)  # [0, 1]
    assert a == [0, 1]
    h0 = hash_block(NO_PARENT, [1, 2])
    assert pool.cache_block(0, h0)
    pool.touch([0])  # a second sequence hits block 0 while the first still holds it
    assert pool.ref_cnt(0) == 2
    pool.free(a)
    assert pool.ref_cnt(0) == 1 and pool.ref_cnt(1) == 0
    assert pool.free_queue() == [2, 3, 1]
    pool.free([0])
    assert pool.free_queue() == [2, 3, 1, 0]
    assert pool.get_cached_block(h0) == 0  # still cached while free


def test_hit_on_free_cached_block_removes_it_from_queue() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(3)  # [0, 1, 2]
    assert blocks is not None
    hashes = hash_blocks(list(range(6)), 2, 0, NO_PARENT, 3)
    for block_id, h in zip(blocks, hashes, strict=True):
        assert pool.cache_block(block_id, h)
    pool.free(blocks)
    assert pool.free_queue() == [3, 4, 2, 1, 0]
    hit = [pool.get_cached_block(h) for h in hashes[:2]]
    assert hit == [0, 1]
    pool.touch([0, 1])
    assert pool.free_queue() == [3, 4, 2]
    assert pool.ref_cnt(0) == pool.ref_cnt(1) == 1
    assert pool.usage == pytest.approx(2 / 5)


def test_eviction_order_and_hash_dropped_when_reallocated() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3]
    assert a is not None and b is not None
    ha = hash_blocks([1, 1, 2, 2], 2, 0, NO_PARENT, 2)
    hb = hash_blocks([3, 3, 4, 4], 2, 0, NO_PARENT, 2)
    for block_id, h in zip(a + b, ha + hb, strict=True):
        assert pool.cache_block(block_id, h)
    pool.free(a)  # queue: [1, 0]
    pool.free(b)  # queue: [1, 0, 3, 2]
    assert pool.free_queue() == [1, 0, 3, 2]
    assert pool.num_cached_blocks == 4
    assert pool.allocate(1) == [1]  # a's tail block goes first
    assert pool.get_cached_block(ha[1]) is None
    assert pool.block_hash(1) is None
    assert pool.get_cached_block(ha[0]) == 0  # a's head survives
    assert pool.allocate(2) == [0, 3]
    assert pool.get_cached_block(ha[0]) is None
    assert pool.get_cached_block(hb[1]) is None
    assert pool.get_cached_block(hb[0]) == 2
    pool.check_invariants()


def test_cache_block_refuses_duplicates_free_blocks_and_when_disabled() -> None:
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    h = hash_block(NO_PARENT, [5])
    assert pool.cache_block(0, h)
    assert pool.cache_block(0, h)  # idempotent
    assert not pool.cache_block(1, h)  # another block already holds this hash
    assert pool.block_hash(1) is None
    with pytest.raises(BlockPoolError):
        pool.cache_block(2, hash_block(NO_PARENT, [6]))  # not held
    with pytest.raises(BlockPoolError):
        pool.cache_block(0, hash_block(NO_PARENT, [6]))  # re-keying a cached block
    off = BlockPool(2, enable_caching=False)
    assert off.allocate(1) == [0]
    assert not off.cache_block(0, h)
    assert off.get_cached_block(h) is None


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.cache_block(blocks[0], b"x" * 32)
    assert not pool.reset_prefix_cache()
    pool.free(blocks)
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.block_hash(0) is None


# ---------------------------------------------------------------------------- KV manager


def test_kv_manager_prefix_lookup_keeps_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prompt = list(range(12))  # exactly 3 full blocks
    assert kv.find_cached_prefix(0, prompt) == []
    assert kv.allocate_slots(0, prompt, 0, 12)
    assert kv.block_table(0) == (0, 1, 2)
    # All three blocks are cached at allocation time (the step fills them).
    assert kv.pool.num_cached_blocks == 3
    # Another sequence with the same 12 tokens may reuse only 2 blocks: it must compute
    # at least its last token to get logits.
    assert kv.find_cached_prefix(1, prompt) == [0, 1]
    # A longer prompt with the same first 12 tokens reuses all three.
    assert kv.find_cached_prefix(2, [*prompt, 99]) == [0, 1, 2]
    # A different first token: no hit at all (the hashes chain).
    assert kv.find_cached_prefix(3, [7, *prompt[1:]]) == []


def test_kv_manager_allocate_with_hits_and_free_tail_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = list(range(10))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots(0, a, 0, 10)
    assert kv.block_table(0) == (0, 1, 2)
    kv.remove(0)  # finished: queue [3, 4, 5, 2, 1, 0], blocks 0, 1 cached
    assert kv.pool.free_queue() == [3, 4, 5, 2, 1, 0]
    b = [*a[:8], 50, 51, 52, 53, 54]
    hits = kv.find_cached_prefix(1, b)
    assert hits == [0, 1]
    assert kv.allocate_slots(1, b, 0, len(b) - 8, hits)
    # 13 tokens need 4 blocks: the two hits plus two from the queue head.
    assert kv.block_table(1) == (0, 1, 3, 4)
    assert [kv.pool.ref_cnt(i) for i in range(6)] == [1, 1, 0, 1, 1, 0]
    assert kv.pool.free_queue() == [5, 2]


def test_kv_manager_capacity_counts_free_hits() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5]
    assert kv.allocate_slots(0, tokens, 0, 5)
    kv.remove(0)  # all three blocks free; 0 and 1 cached
    hits = kv.find_cached_prefix(1, [1, 2, 3, 4, 9, 9, 9, 9])
    assert hits == [0, 1]
    # 8 tokens need 4 blocks: 2 hits (both in the free queue) + 2 new > 3 free blocks.
    assert not kv.allocate_slots(1, [1, 2, 3, 4, 9, 9, 9, 9], 0, 4, hits)
    assert kv.pool.num_free_blocks == 3 and kv.block_table(1) == ()
    assert kv.allocate_slots(1, [1, 2, 3, 4, 9, 9], 0, 2, hits)
    assert kv.block_table(1) == (0, 1, 2)


def test_kv_manager_decode_caches_a_full_block_at_the_next_allocation() -> None:
    """A decode step that fills a block needs no pool work (it is within the fast limit);
    the block is hashed and cached once, by the allocation of the block after it."""
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    tokens = [1, 2, 3]
    rec = kv.allocate_slots(0, tokens, 0, 3)  # blocks 0 (full), 1 (partial)
    assert rec and rec.fast_limit == 4
    assert kv.pool.num_cached_blocks == 1
    tokens.append(4)  # a decode fills block 1: served from the fast limit
    assert kv.block_table(0) == (0, 1) and kv.pool.block_hash(1) is None
    tokens.append(5)
    assert kv.allocate_slots(0, tokens, 4, 1)
    assert kv.block_table(0) == (0, 1, 2)
    assert kv.pool.block_hash(1) == hash_blocks(tokens, 2, 0, NO_PARENT, 2)[1]
    assert kv.pool.num_cached_blocks == 2
    assert kv.find_cached_prefix(1, [1, 2, 3, 4, 9]) == [0, 1]


def test_kv_manager_caches_blocks_that_decodes_filled_when_it_frees_them() -> None:
    """A sequence that ends (or is preempted) right after a decode filled a block offers
    that block when its blocks are freed, up to the positions its steps computed."""
    for release in ("remove", "free"):
        kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
        tokens = [1, 2, 3]
        assert kv.allocate_slots(0, tokens, 0, 3)
        tokens += [4, 5]  # the decode of 4 filled block 1; 5's K/V are not computed
        getattr(kv, release)(0, tokens, 4)
        assert kv.pool.num_cached_blocks == 2, release
        assert kv.find_cached_prefix(1, [1, 2, 3, 4, 9]) == [0, 1]
        # a block whose last position no step computed is not offered
        kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
        assert kv.allocate_slots(0, [1, 2, 3], 0, 3)
        getattr(kv, release)(0, [1, 2, 3, 4], 3)
        assert kv.pool.num_cached_blocks == 1, release


def test_kv_manager_allocate_running_is_allocate_slots_for_each_in_order() -> None:
    """Growing running sequences at once hands out the same blocks, tables, cached blocks
    and fast limits as growing them one by one; short of blocks for all, it changes
    nothing."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [1, 2, 9]]

    def started() -> KVCacheManager:
        kv = KVCacheManager(num_blocks=10, block_size=2, enable_prefix_caching=True)
        for seq_id, tokens in enumerate(prompts):
            assert kv.allocate_slots(seq_id, tokens, 0, len(tokens))
        return kv

    grown = [[*p, 10, 11] for p in prompts]  # two decodes each, computed up to the last
    totals = [len(g) for g in grown]
    one_by_one, at_once = started(), started()
    for seq_id, tokens in enumerate(grown):
        assert one_by_one.allocate_slots(seq_id, tokens, totals[seq_id] - 1, 1)
    recs = at_once.allocate_running([0, 1, 2], grown, totals)
    assert recs is not None
    for seq_id, rec in enumerate(recs):
        expected = one_by_one.seq_blocks(seq_id)
        assert expected is not None
        assert rec.table == expected.table and rec.fast_limit == expected.fast_limit
        assert rec.num_cached_blocks == expected.num_cached_blocks
    assert at_once.pool.free_queue() == one_by_one.pool.free_queue()
    assert at_once.pool.num_cached_blocks == one_by_one.pool.num_cached_blocks

    short = started()  # 7 blocks held, 3 free: 8 positions each need 5 more together
    before = [short.block_table(seq_id) for seq_id in range(3)]
    assert short.allocate_running([0, 1, 2], grown, [8, 8, 8]) is None
    assert [short.block_table(seq_id) for seq_id in range(3)] == before
    assert short.pool.num_free_blocks == 3


def test_kv_manager_allocate_running_offers_blocks_after_handing_out_the_new_ones() -> None:
    """A full block whose hash sits on a free block that the same call hands out (to a
    later sequence) is cached on the sequence's own block: the call's allocations come
    before its offers."""
    kv = KVCacheManager(num_blocks=5, block_size=2, enable_prefix_caching=True)
    assert kv.allocate_slots(0, [1, 2, 3], 0, 3)  # blocks 0, 1
    kv.remove(0, [1, 2, 3, 4], 4)  # [1, 2] cached on 0, [1, 2, 3, 4] on 1; queue 2 3 4 1 0
    assert kv.allocate_slots(1, [1, 2, 3], 0, 3)  # blocks 2, 3; [1, 2] stays on 0
    assert kv.allocate_slots(2, [7, 8], 0, 2)  # block 4; queue 1 0
    recs = kv.allocate_running([1, 2], [[1, 2, 3, 4], [7, 8, 9]], [4, 3])
    assert recs is not None
    assert recs[1].table == (4, 1)  # sequence 2's new block evicted [1, 2, 3, 4] from 1
    assert kv.find_cached_prefix(3, [1, 2, 3, 4, 5]) == [0, 3]  # now on sequence 1's block
    kv.pool.check_invariants()


def test_kv_manager_without_prefix_caching_never_hits() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    assert kv.allocate_slots(0, [1, 2, 3, 4], 0, 4)
    assert kv.find_cached_prefix(1, [1, 2, 3, 4, 5]) == []
    assert kv.pool.num_cached_blocks == 0


# ---------------------------------------------------------------------------- state machine


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / hit / free sequences against a plain-list model:
    the model's free queue is a Python list with the documented order, holders are lists
    of block ids, and the cache is a dict."""

    @initialize(num_blocks=st.integers(1, 12))
    def setup(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.model_free: list[int] = list(range(num_blocks))
        self.model_ref = [0] * num_blocks
        self.model_cache: dict[bytes, int] = {}
        self.model_hash: list[bytes | None] = [None] * num_blocks
        self.holders: list[list[int]] = []
        self.counter = 0

    def _fresh_hash(self) -> bytes:
        self.counter += 1
        return hash_block(NO_PARENT, [self.counter])

    @rule(n=st.integers(0, 6))
    def allocate(self, n: int) -> None:
        got = self.pool.allocate(n)
        if n > len(self.model_free):
            assert got is None
            return
        expected = self.model_free[:n]
        del self.model_free[:n]
        for b in expected:
            old = self.model_hash[b]
            if old is not None and self.model_cache.get(old) == b:
                del self.model_cache[old]
            self.model_hash[b] = None
            self.model_ref[b] = 1
        assert got == expected
        self.holders.append(list(expected))

    @precondition(lambda self: any(self.holders))
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        holder = data.draw(st.sampled_from([h for h in self.holders if h]))
        block = data.draw(st.sampled_from(holder))
        if self.model_hash[block] is not None:
            return
        reuse = self.model_cache and data.draw(st.booleans())
        h = data.draw(st.sampled_from(sorted(self.model_cache))) if reuse else self._fresh_hash()
        ok = self.pool.cache_block(block, h)
        assert ok == (h not in self.model_cache)
        if ok:
            self.model_cache[h] = block
            self.model_hash[block] = h

    @precondition(lambda self: bool(self.model_cache))
    @rule(data=st.data())
    def hit(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.model_cache)))
        block = self.pool.get_cached_block(h)
        assert block == self.model_cache[h]
        self.pool.touch([block])
        if self.model_ref[block] == 0:
            self.model_free.remove(block)
        self.model_ref[block] += 1
        self.holders.append([block])

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.holders) - 1))
        blocks = self.holders.pop(i)
        self.pool.free(blocks)
        for b in reversed(blocks):
            self.model_ref[b] -= 1
            if self.model_ref[b] == 0:
                self.model_free.append(b)

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_invariants()
        assert self.pool.free_queue() == self.model_free
        n = self.pool.num_blocks
        assert [self.pool.ref_cnt(b) for b in range(n)] == self.model_ref
        held = [0] * n
        for holder in self.holders:
            for b in holder:
                held[b] += 1
        assert held == self.model_ref
        for h, b in self.model_cache.items():
            assert self.pool.get_cached_block(h) == b
        assert self.pool.num_cached_blocks == len(self.model_cache)
        assert self.pool.usage == pytest.approx((n - len(self.model_free)) / n)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------------- cache salts


def test_salt_root_chains_the_first_block() -> None:
    assert salt_root(None) == NO_PARENT
    root = salt_root("tenant-a")
    assert root == hashlib.sha256(b"flowllm-cache-salt\0tenant-a").digest()
    assert root != salt_root("tenant-b")
    tokens = list(range(8))
    salted = hash_blocks(tokens, 4, 0, root, 2)
    assert salted[0] == reference_hash(root, tokens[:4])
    assert salted[1] == reference_hash(salted[0], tokens[4:])
    assert set(salted).isdisjoint(hash_blocks(tokens, 4, 0, NO_PARENT, 2))


def _cached(kv: KVCacheManager, seq_id: int, tokens: list[int], salt: str | None) -> None:
    kv.set_cache_salt(seq_id, salt)
    assert kv.find_cached_prefix(seq_id, tokens) == []
    assert kv.allocate_slots(seq_id, tokens, 0, len(tokens))
    kv.remove(seq_id)


@pytest.mark.parametrize(
    ("writer", "reader", "hits"),
    [
        ("a", "a", True),  # same salt: shared
        ("a", "b", False),  # another tenant's salt
        ("a", None, False),  # no salt never hits salted blocks
        (None, "a", False),  # a salt never hits unsalted blocks
        (None, None, True),  # the default: shared, as before
    ],
)
def test_prefix_cache_is_isolated_per_salt(
    writer: str | None, reader: str | None, hits: bool
) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(13))
    _cached(kv, 0, prompt, writer)
    assert kv.pool.num_cached_blocks == 3
    kv.set_cache_salt(1, reader)
    found = kv.find_cached_prefix(1, prompt)
    assert found == ([0, 1, 2] if hits else [])
    # A reader that misses caches its own copies under its own salt, next to the writer's.
    assert kv.allocate_slots(1, prompt, len(found) * 4, len(prompt) - len(found) * 4, found)
    assert kv.pool.num_cached_blocks == (3 if hits else 6)
    kv.pool.check_invariants()


def test_salt_must_be_set_before_hashing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    kv.find_cached_prefix(0, list(range(9)))
    with pytest.raises(ValueError, match="salt"):
        kv.set_cache_salt(0, "late")


def test_salted_blocks_of_a_sequence_without_lookups_stay_salted() -> None:
    """A request that skips lookups (prompt logprobs) still offers its blocks under its
    salt, so others cannot hit them."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(9))
    kv.set_cache_salt(0, "secret")
    assert kv.allocate_slots(0, prompt, 0, len(prompt))  # no find_cached_prefix first
    assert kv.find_cached_prefix(1, prompt) == []
    kv.set_cache_salt(2, "secret")
    assert kv.find_cached_prefix(2, prompt) == [0, 1]
