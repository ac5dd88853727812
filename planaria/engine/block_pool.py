"""Paged KV block pool: reference counts, an LRU free list and a prefix cache keyed by
chained block hashes. Pure Python (no torch).

A block is *cached* when it holds a full block of tokens whose chained hash is known;
a cached block whose ref count drops to zero stays in the cache (and in the free list)
until it is evicted for reuse, least recently freed first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

# Seed of the hash chain. A constant (not Python's randomized hash) so that block hashes
# are the same in every process and survive a restart.
NONE_HASH = int.from_bytes(hashlib.blake2b(b"planaria-kv-v1", digest_size=8).digest(), "little")


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """Chained hash of one full block: depends on every token before it."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    if extra:
        h.update(extra)
    return int.from_bytes(h.digest(), "little")


def hash_request_blocks(token_ids: Sequence[int], block_size: int, existing: list[int]) -> list[int]:
    """Extend ``existing`` (hashes of the first len(existing) blocks) over every full block."""
    num_full_blocks = len(token_ids) // block_size
    parent = existing[-1] if existing else NONE_HASH
    for i in range(len(existing), num_full_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        existing.append(parent)
    return existing


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks in LRU order: the first entry is evicted first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.num_cache_hits_blocks = 0
        self.num_cache_queries_blocks = 0

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    # -- actions -------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks, {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks found by a prefix hit."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Pass the blocks tail first: the tail of a
        sequence is then evicted before its (more shareable) head."""
        for block_id in block_ids:
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: int) -> None:
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self._cached:  # same content already cached elsewhere
            return
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            if self._cached.get(h) == block_id:
                del self._cached[h]
