"""The paged KV cache's block pool: preallocated block ids, reference counts, a free queue,
and the prefix cache (full blocks keyed by chained hashes).

Block ids index the first dimension of every layer's preallocated KV tensor; this module
only does the bookkeeping, never touches tensors.

Free queue and eviction order
-----------------------------
Every block with reference count 0 sits in one free queue (an `OrderedDict`, so a cached
block that is hit again leaves the queue in O(1)). A free block may still hold a cached
hash: its K/V stay valid until the block is handed out again.

* At start the queue is ``[0, 1, ..., num_blocks - 1]``.
* `allocate` pops from the head. A popped block that still carries a hash is evicted
  from the prefix cache at that moment. So the head is the least recently freed block.
* `free` takes a sequence's blocks in block-table order and appends those whose count
  drops to 0 to the tail **in reverse** (the sequence's last block first). Hence:
  least recently freed blocks are evicted first, and within one freed sequence its tail
  blocks go before its head blocks, so shared prefixes (system prompts) survive longest.
* `touch` (a prefix-cache hit) takes a free cached block out of the queue and counts one
  more reference; a block in use just gains a reference.

Block hashes
------------
The hash of full block i of a token list is ``sha256(hash(i - 1) + its block_size token
ids packed as little-endian int64)``, with ``hash(-1) = b""``. It depends on every token before the
block, so equal hashes mean equal prefixes (up to SHA-256 collisions), it is stable across
processes (traces can be compared), and a sequence computes each block's hash once, when
the block fills. Only full blocks are ever cached.
"""

from __future__ import annotations

import functools
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from hashlib import sha256

BlockHash = bytes  # 32-byte SHA-256 digest
NO_PARENT: BlockHash = b""


class BlockPoolError(RuntimeError):
    """The pool was used against its contract (a bookkeeping bug, never user input)."""


def salt_root(cache_salt: str | None) -> BlockHash:
    """The parent hash of a sequence's first block: b"" without a salt."""
    if cache_salt is None:
        return NO_PARENT
    return sha256(b"flowllm-cache-salt\0" + cache_salt.encode()).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: `parent` is the previous block's hash (or b"")."""
    return sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


@functools.cache
def _packer(block_size: int) -> Callable[..., bytes]:
    """Packs one block's token ids as little-endian int64 (one Struct per block size: making
    one per call would cost more than the packing)."""
    return struct.Struct(f"<{block_size}q").pack


def hash_blocks(
    token_ids: Sequence[int], block_size: int, start: int, parent: BlockHash, stop: int
) -> list[BlockHash]:
    """Hashes of full blocks `start` .. `stop - 1` of `token_ids`, chained from `parent`
    (the hash of block `start - 1`, or b"" when start is 0)."""
    pack = _packer(block_size)
    out: list[BlockHash] = []
    for i in range(start, stop):
        parent = sha256(parent + pack(*token_ids[i * block_size : (i + 1) * block_size])).digest()
        out.append(parent)
    return out


class BlockPool:
    """Preallocated KV blocks with reference counts, a free queue and the prefix cache.

    Pair every capacity check with its commit: callers ask `num_free_blocks` (and count the
    free cached blocks they will `touch`) before `allocate`, which returns None when short.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_cnt: list[int] = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        # block_id -> None, ordered head (next to hand out) to tail (most recently freed).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Prefix cache: one block per hash (a second block with an equal hash stays uncached).
        self._cached: dict[BlockHash, int] = {}

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out now (cached-but-free blocks included)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use; cached-but-free blocks count as free."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash[block_id]

    def free_queue(self) -> list[int]:
        """The free queue, head (next evicted) first. O(num free blocks): for tests."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding the full block with this chained hash, if cached."""
        return self._cached.get(block_hash)

    # ----------------------------------------------------------------- commits
    def allocate(self, n: int) -> list[int] | None:
        """Hand out `n` blocks from the queue head with count 1, evicting their cached
        hashes; None (and nothing changed) if fewer than `n` are free."""
        if n > len(self._free):
            return None
        free, ref_cnt, hashes, cached = self._free, self._ref_cnt, self._hash, self._cached
        out: list[int] = []
        for _ in range(n):
            block_id, _ = free.popitem(last=False)
            old = hashes[block_id]
            if old is not None:
                if cached.get(old) == block_id:
                    del cached[old]
                hashes[block_id] = None
            ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Count one more holder of each block (prefix-cache hits); free ones leave the
        queue, so they can no longer be evicted."""
        free, ref_cnt = self._free, self._ref_cnt
        for block_id in block_ids:
            if ref_cnt[block_id] == 0:
                del free[block_id]
            ref_cnt[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one holder of each block. `block_ids` is in block-table order; blocks whose
        count reaches 0 join the queue tail in reverse order (tail blocks evicted first)."""
        free, ref_cnt = self._free, self._ref_cnt
        for block_id in reversed(block_ids):
            count = ref_cnt[block_id]
            if count <= 0:
                raise BlockPoolError(f"block {block_id} freed more often than held")
            ref_cnt[block_id] = count - 1
            if count == 1:
                free[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a held, full block under its chained hash. Returns False (and leaves
        the block uncached) when caching is off or another block already has this hash."""
        if not self.enable_caching:
            return False
        if self._ref_cnt[block_id] <= 0:
            raise BlockPoolError(f"block {block_id} must be held to be cached")
        current = self._hash[block_id]
        if current is not None:
            if current != block_hash:
                raise BlockPoolError(f"block {block_id} is already cached under another hash")
            return True
        if block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self._hash[block_id] = block_hash
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        return True

    def check_invariants(self) -> None:
        """Raise BlockPoolError if the bookkeeping is inconsistent. O(num_blocks): tests."""
        for block_id in range(self.num_blocks):
            count = self._ref_cnt[block_id]
            if count < 0:
                raise BlockPoolError(f"block {block_id} has count {count}")
            if (count == 0) != (block_id in self._free):
                raise BlockPoolError(f"block {block_id}: count {count} vs free queue")
        if len(self._free) + sum(1 for c in self._ref_cnt if c > 0) != self.num_blocks:
            raise BlockPoolError("free + used != total")
        for block_hash, block_id in self._cached.items():
            if self._hash[block_id] != block_hash:
                raise BlockPoolError(f"cache maps a hash to block {block_id} without it")
        for block_id, carried in enumerate(self._hash):
            if carried is not None and self._cached.get(carried) != block_id:
                raise BlockPoolError(f"block {block_id} carries a hash the cache lost")
