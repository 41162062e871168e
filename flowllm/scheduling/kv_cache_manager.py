"""Per-sequence block tables on top of the block pool: prefix lookups, slot allocation,
hashing each full block once, and freeing.

It owns each sequence's block table and block hashes (keyed by seq id) and reads, never
edits, the scheduler's token lists. Hashes survive preemption (they depend on tokens
only), so a recomputed sequence looks its own blocks up again for free.

Same-step reuse: a block is registered in the prefix cache by the allocation of the step
that fills it, before that step runs, so a sibling (or any sequence) admitted later in the
same step, or in a later step, may hit it. That is sound because the model writes every
row's K/V of a layer into the cache before that layer attends, and steps run in the order
they were scheduled, so the block's K/V exist whenever a hit reads them. A block that
decode steps fill, which need no allocation, is registered one step later, by the
allocation of the block after it, or when the sequence's blocks are freed: a decode step
then does pool work once per block, not twice.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowllm.scheduling.block_pool import NO_PARENT, BlockHash, BlockPool, hash_blocks, salt_root


class SeqBlocks:
    """One sequence's blocks; callers read `table` and `fast_limit`, only the manager
    writes. Invariants: block_ids[:num_cached_blocks] were offered to the prefix cache;
    block_hashes[i] is the chained hash of full block i of the sequence's tokens; `table`
    is tuple(block_ids)."""

    __slots__ = ("block_hashes", "block_ids", "fast_limit", "num_cached_blocks", "root", "table")

    def __init__(self, root: BlockHash = NO_PARENT) -> None:
        self.root = root  # the parent hash of block 0: the cache salt's root, or b""
        self.block_ids: list[int] = []
        self.block_hashes: list[BlockHash] = []
        self.num_cached_blocks = 0
        self.table: tuple[int, ...] = ()
        # Largest `num_computed + num_new` that allocate_slots serves without pool work (no
        # new block): the scheduler's per-decode fast path.
        self.fast_limit = 0


class KVCacheManager:
    """Allocates KV slots for sequences from one `BlockPool`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._seqs: dict[int, SeqBlocks] = {}

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _record(self, seq_id: int) -> SeqBlocks:
        rec = self._seqs.get(seq_id)
        if rec is None:
            rec = self._seqs[seq_id] = SeqBlocks()
        return rec

    def set_cache_salt(self, seq_id: int, cache_salt: str | None) -> None:
        """Isolate the sequence's prefix-cache entries under `cache_salt` (before it is
        first looked up or allocated): it hits, and offers, only blocks of that salt."""
        rec = self._record(seq_id)
        if rec.block_hashes or rec.block_ids:
            raise ValueError(f"sequence {seq_id} already hashed blocks; set its salt first")
        rec.root = salt_root(cache_salt)

    def _ensure_hashes(self, rec: SeqBlocks, token_ids: Sequence[int], num_blocks: int) -> None:
        have = len(rec.block_hashes)
        if have < num_blocks:
            parent = rec.block_hashes[-1] if have else rec.root
            rec.block_hashes.extend(
                hash_blocks(token_ids, self.block_size, have, parent, num_blocks)
            )

    def find_cached_prefix(self, seq_id: int, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached run of full blocks at the start of `token_ids`,
        leaving at least the last token to compute (the model must produce its logits).
        Changes nothing in the pool."""
        if not self.enable_prefix_caching:
            return []
        rec = self._record(seq_id)
        max_blocks = (len(token_ids) - 1) // self.block_size
        self._ensure_hashes(rec, token_ids, max_blocks)
        hits: list[int] = []
        get = self.pool.get_cached_block
        for block_hash in rec.block_hashes[:max_blocks]:
            block_id = get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: Sequence[int] = (),
    ) -> SeqBlocks | None:
        """Make the sequence's table cover `num_computed_tokens + len(cached_blocks) *
        block_size + num_new_tokens` positions, first adopting the prefix-cache hits
        `cached_blocks` (only on a sequence with no blocks), and offer every block that
        this step fills to the prefix cache. Returns the sequence's block record, or None,
        changing nothing, when the pool is short: the caller decides whom to preempt."""
        rec = self._seqs.get(seq_id) or self._record(seq_id)
        bs = self.block_size
        if not cached_blocks and num_computed_tokens + num_new_tokens <= rec.fast_limit:
            return rec
        if cached_blocks and rec.block_ids:
            raise ValueError(f"sequence {seq_id} already holds blocks; hits apply at start")
        total = num_computed_tokens + len(cached_blocks) * bs + num_new_tokens
        pool = self.pool
        # Free cached hits leave the free queue when touched, so they count against it.
        need = max(-(-total // bs) - len(rec.block_ids) - len(cached_blocks), 0)
        if cached_blocks:
            need += sum(1 for b in cached_blocks if pool.ref_cnt(b) == 0)
        if need > pool.num_free_blocks:
            return None
        if cached_blocks:
            pool.touch(cached_blocks)
            rec.block_ids.extend(cached_blocks)
            rec.num_cached_blocks = len(cached_blocks)
        if not self._grow((rec,), (token_ids,), (total,)):
            raise RuntimeError("block pool short after a successful capacity check")
        return rec

    def allocate_running(
        self,
        seq_ids: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        totals: Sequence[int],
    ) -> list[SeqBlocks] | None:
        """`allocate_slots` without hits for many sequences at once: sequence i's table
        covers `totals[i]` positions. The blocks come from the pool in one call, handed out
        in the sequences' order, and the blocks the positions fill are offered to the prefix
        cache after that. Returns their block records, or None, changing nothing, when the
        pool lacks the blocks they need together (the caller then goes one by one, to decide
        whom to preempt)."""
        seqs = self._seqs
        recs = [seqs.get(seq_id) or self._record(seq_id) for seq_id in seq_ids]
        return recs if self._grow(recs, token_lists, totals) else None

    def _grow(
        self, recs: Sequence[SeqBlocks], token_lists: Sequence[Sequence[int]], totals: Sequence[int]
    ) -> bool:
        """Give each sequence the blocks that its `total` positions need, from one pool call
        in the sequences' order, renew their tables and fast limits, then offer the prefix
        cache the blocks those positions fill. False, changing nothing, when the pool lacks
        the blocks."""
        bs = self.block_size
        missing = [-(-t // bs) - len(r.block_ids) for r, t in zip(recs, totals, strict=True)]
        new = self.pool.allocate(sum(m for m in missing if m > 0))
        if new is None:
            return False
        at = 0
        for rec, m in zip(recs, missing, strict=True):
            block_ids = rec.block_ids
            if m > 0:
                block_ids += new[at : at + m]
                at += m
            if len(rec.table) != len(block_ids):  # blocks added, or hits adopted
                rec.table = tuple(block_ids)
            rec.fast_limit = len(block_ids) * bs
        self._cache_full_blocks(recs, token_lists, totals)
        return True

    def _cache_full_blocks(
        self, recs: Sequence[SeqBlocks], token_lists: Sequence[Sequence[int]], uptos: Sequence[int]
    ) -> None:
        """Offer the prefix cache every full block among each sequence's first `upto`
        positions (those a scheduled step computes) not offered yet."""
        if not self.enable_prefix_caching:
            return
        bs, cache, ensure_hashes = self.block_size, self.pool.cache_block, self._ensure_hashes
        for rec, token_ids, upto in zip(recs, token_lists, uptos, strict=True):
            num_full = min(upto, len(token_ids)) // bs
            first = rec.num_cached_blocks
            if num_full <= first:
                continue
            ensure_hashes(rec, token_ids, num_full)
            hashes, block_ids = rec.block_hashes, rec.block_ids
            for i in range(first, num_full):
                cache(block_ids[i], hashes[i])
            rec.num_cached_blocks = num_full

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        """The sequence's block ids as a tuple (rebuilt only when blocks are added)."""
        rec = self._seqs.get(seq_id)
        return () if rec is None else rec.table

    def seq_blocks(self, seq_id: int) -> SeqBlocks | None:
        """The sequence's block record, to read `table` and `fast_limit` without a call
        per decode on the scheduler's hot path. Never edit it."""
        return self._seqs.get(seq_id)

    def free(
        self, seq_id: int, token_ids: Sequence[int] = (), num_computed_tokens: int = 0
    ) -> None:
        """Return the sequence's blocks to the pool (tail first), first offering the prefix
        cache the full blocks among its `num_computed_tokens` positions that decode steps
        filled since its last allocation; keep its hashes, since a preempted sequence
        recomputes the same tokens."""
        rec = self._seqs.get(seq_id)
        if rec is None or not rec.block_ids:
            return
        self._cache_full_blocks((rec,), (token_ids,), (num_computed_tokens,))
        self.pool.free(rec.block_ids)
        rec.block_ids = []
        rec.num_cached_blocks = 0
        rec.table = ()
        rec.fast_limit = 0

    def remove(
        self, seq_id: int, token_ids: Sequence[int] = (), num_computed_tokens: int = 0
    ) -> None:
        """Free the sequence's blocks (as `free`) and forget it (it finished or was
        aborted)."""
        self.free(seq_id, token_ids, num_computed_tokens)
        self._seqs.pop(seq_id, None)
