"""Paged KV block pool: reference counts, an LRU free list and a prefix cache keyed by
chained block hashes. Pure Python (no torch).

A block is *cached* when it holds a full block of tokens whose chained hash is known;
a cached block whose ref count drops to zero stays in the cache (and in the free list)
until it is evicted for reuse, least recently freed first.

A finished request's last block, not full, is kept too (``cache_partial``): free, in the
LRU order, under the hash of its positions (``hash_partial_block``) and the hash of the
full block before it. A later request whose cached prefix ends at that full block and
whose next tokens are those positions takes the block over (``take_partial``: it then
writes the rest of it, so the block is its own, not shared): a conversation's next turn
computes from where the reply ended, not from the reply's last full block.

A request's ``cache_salt`` (a tenant's secret, vLLM's field) seeds its hash chain
(``chain_root``): blocks of one salt never match another salt's, nor unsalted ones.

The pool notes every change of its cache (a hash stored, a hash evicted, the whole cache
reset) for ``take_events``: the engine publishes them once per step, and frontends keep a
per-engine index of cached prefixes from them to route a request to the engine that holds
its prefix (engine/prefix_index.py). What is pending is the net change since the last take,
one entry per hash, so it never holds more than ``max_pending_events`` entries: past that
the next take is a snapshot (``cleared`` and every cached hash) instead.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

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


PARTIAL_MARK = b"\x00planaria-partial"


def hash_partial_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of the first ``len(token_ids)`` positions of a block that is not full yet (a KV
    segment's record of a request's last block, engine/kv_segment.py): never a full block's
    hash, and never another length's."""
    return hash_block_tokens(parent_hash, token_ids, PARTIAL_MARK + len(token_ids).to_bytes(2, "little"))


def chain_root(cache_salt: str | None) -> int:
    """The parent hash of a request's first block: NONE_HASH, or one of the salt's own."""
    if not cache_salt:
        return NONE_HASH
    h = hashlib.blake2b(b"planaria-kv-v1\x00salt\x00", digest_size=8)
    h.update(cache_salt.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little")


def block_parent(hashes: Sequence[int], num_blocks: int, cache_salt: str | None = None) -> int:
    """The parent of block ``num_blocks`` of a chain whose full blocks hash to ``hashes``:
    the hash of the block before it, or the chain's root for the first."""
    return hashes[num_blocks - 1] if num_blocks else chain_root(cache_salt)


def hash_request_blocks(token_ids: Sequence[int], block_size: int, existing: list[int],
                        cache_salt: str | None = None) -> list[int]:
    """Extend ``existing`` (hashes of the first len(existing) blocks) over every full block:
    linear in the tokens not hashed yet. The engine and the frontend's router both hash
    with this function, so their hashes agree."""
    num_full_blocks = len(token_ids) // block_size
    if len(existing) >= num_full_blocks:
        return existing
    parent = block_parent(existing, len(existing), cache_salt)
    for i in range(len(existing), num_full_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        existing.append(parent)
    return existing


@dataclass
class CacheEvents:
    """The net change of a pool's cache since the last ``take_events``. ``cleared``: forget
    every block first (a reset, or a snapshot after the pending changes overflowed)."""

    cleared: bool = False
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 max_pending_events: int | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Free blocks in LRU order: the first entry is evicted first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        # cache_partial: parent hash -> {partial hash -> (block id, positions)}, and back
        self._partials: dict[int, dict[int, tuple[int, int]]] = {}
        self._partial_of: dict[int, tuple[int, int]] = {}  # block id -> (parent hash, partial hash)
        self.num_cache_hits_blocks = 0
        self.num_cache_queries_blocks = 0
        # take_events: block hash -> cached now (True) or evicted (False), the net change
        # since the last take; past max_pending_events a snapshot is due instead
        self._pending: dict[int, bool] = {}
        self._snapshot_due = False
        self.max_pending_events = max_pending_events or 2 * num_blocks + 64

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
        self._note(block_hash, True)

    def cache_partial(self, block_id: int, parent_hash: int, token_ids: Sequence[int]) -> bool:
        """Keep a free block whose first ``len(token_ids)`` positions (not all) hold the KV
        of ``token_ids`` after the full block ``parent_hash``, for ``take_partial``."""
        n = len(token_ids)
        if not self.enable_caching or self.ref_cnt[block_id] != 0 or n <= 0 or block_id in self._partial_of:
            return False
        key = hash_partial_block(parent_hash, token_ids)
        entries = self._partials.setdefault(parent_hash, {})
        if key in entries:  # the same positions kept already
            return False
        entries[key] = (block_id, n)
        self._partial_of[block_id] = (parent_hash, key)
        return True

    def find_partial(self, parent_hash: int, token_ids: Sequence[int], max_positions: int) -> tuple[int, int] | None:
        """(block id, positions) of a kept partial block after ``parent_hash`` whose
        positions are the first ones of ``token_ids`` (the longest, at most
        ``max_positions``), or None. At most one hash per length, whatever is kept."""
        entries = self._partials.get(parent_hash) if self.enable_caching else None
        if not entries:
            return None
        for n in range(min(max_positions, len(token_ids)), 0, -1):
            hit = entries.get(hash_partial_block(parent_hash, token_ids[:n]))
            if hit is not None and hit[1] == n:
                return hit
        return None

    def take_partial(self, block_id: int) -> None:
        """The block found by find_partial, out of the free list: the caller's own now (ref 1)."""
        self._drop_partial(block_id)
        del self._free[block_id]
        self.ref_cnt[block_id] = 1

    @property
    def num_partial_blocks(self) -> int:
        return len(self._partial_of)

    def _drop_partial(self, block_id: int) -> None:
        entry = self._partial_of.pop(block_id, None)
        if entry is not None:
            parent, key = entry
            entries = self._partials[parent]
            del entries[key]
            if not entries:
                del self._partials[parent]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        self._partials.clear()
        self._partial_of.clear()
        self._cached.clear()
        self.block_hash = [None] * self.num_blocks
        self._pending.clear()
        self._snapshot_due = True  # an empty snapshot: "cleared"
        return True

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[int]:
        """Every cached block hash, oldest cached first."""
        return list(self._cached)

    def take_events(self, max_items: int | None = None) -> CacheEvents | None:
        """The cache's net change since the last take (None: no change). Each list holds at
        most ``max_items`` hashes: more changes than that make a snapshot, which holds the
        ``max_items`` most recently cached."""
        if max_items is not None and len(self._pending) > max_items:
            self._snapshot_due = True
        if self._snapshot_due:
            self._snapshot_due = False
            self._pending.clear()
            stored = list(self._cached)
            if max_items is not None and len(stored) > max_items:
                stored = stored[len(stored) - max_items:]
            return CacheEvents(cleared=True, stored=stored)
        if not self._pending:
            return None
        pending, self._pending = self._pending, {}
        return CacheEvents(stored=[h for h, cached in pending.items() if cached],
                           removed=[h for h, cached in pending.items() if not cached])

    def _note(self, block_hash: int, cached: bool) -> None:
        if self._snapshot_due:
            return  # the snapshot will show it
        self._pending[block_hash] = cached
        if len(self._pending) > self.max_pending_events:
            self._pending.clear()
            self._snapshot_due = True

    def _evict(self, block_id: int) -> None:
        if self._partial_of:
            self._drop_partial(block_id)
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            if self._cached.get(h) == block_id:
                del self._cached[h]
                self._note(h, False)
