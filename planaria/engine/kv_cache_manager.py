"""Per-request block tables over a BlockPool, with prefix-cache lookups. No torch.

Each request that holds blocks also has a row of ``block_table`` (numpy, int64), kept as
its blocks change: a decode step reads its batch's rows with one fancy index
(``decode_table``) instead of turning 64 Python lists into an array, which cost more than
the rest of the step's attention metadata at 64 sequences (Python objects the forward has
pushed out of the caches). Rows past a request's own blocks are 0 (a valid block id)."""

from __future__ import annotations

import numpy as np

from planaria.engine.block_pool import BlockPool, CacheEvents, block_parent, hash_partial_block, hash_request_blocks
from planaria.engine.request import Request, RequestStatus

# a request that ended so keeps its last, not-full block for a follow-up (BlockPool.cache_partial)
_KEEPS_TAIL = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # blocks of a request already hashed into the cache
        self.block_table = np.zeros((16, 16), dtype=np.int64)  # grows (doubling) in rows and columns
        self.table_rows: dict[str, int] = {}  # request id -> its row of block_table
        self._free_rows = list(range(15, -1, -1))
        # engine.kv_segment.KVSegment when the cache lives in a segment that outlives the
        # process: blocks handed out are invalidated in its record, committed after the
        # forward that wrote them (``commit``)
        self.record = None
        self._num_committed: dict[str, int] = {}
        # salvaged last blocks, not full (engine/core.py): request id -> (block, positions
        # it holds, full blocks before it), taken by the request's first allocation when its
        # prefix hit is exactly those full blocks, else freed
        self._tails: dict[str, tuple[int, int, int]] = {}
        self.num_partial_hits = 0  # requests that took a finished request's last block over

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks. At least one token is always left to
        compute, so the model produces logits for the next token. A request that still
        wants prompt logprobs gets no hit (as in vLLM): a cached block's positions would
        never run through the model, so their logprobs could not be computed. Its own
        blocks are still offered to later requests."""
        if not self.enable_caching or req.wants_prompt_logprobs:
            return [], 0
        hashes = hash_request_blocks(req.all_token_ids, self.block_size, req.block_hashes, req.cache_salt)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in hashes[:max_blocks]:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hits.append(block_id)
        self.pool.num_cache_queries_blocks += max_blocks
        self.pool.num_cache_hits_blocks += len(hits)
        start = len(hits) * self.block_size
        tail = self._tails.get(req.request_id)
        if tail is None and self.pool.num_partial_blocks:  # a finished request's last block follows them?
            tail = self._take_partial(req, hashes, len(hits))
        if tail is not None and tail[2] == len(hits):  # a salvaged or kept last block follows them
            return hits, start + tail[1]
        return hits, start

    def _take_partial(self, req: Request, hashes: list[int], num_hits: int) -> tuple[int, int, int] | None:
        """The kept last block of a finished request (BlockPool.cache_partial) whose
        positions are this request's next tokens after its ``num_hits`` cached blocks: taken
        for the request's first allocation, as a salvaged tail is (at least one prompt token
        is still left to compute)."""
        start = num_hits * self.block_size
        most = min(self.block_size - 1, req.num_tokens - 1 - start)
        if most <= 0:
            return None
        parent = block_parent(hashes, num_hits, req.cache_salt)
        found = self.pool.find_partial(parent, req.all_token_ids[start:start + most], most)
        if found is None:
            return None
        block, positions = found
        self.pool.take_partial(block)
        if self.record is not None:  # this request writes the rest of it: untrusted until committed
            self.record.invalidate([block])
        tail = self._tails[req.request_id] = (block, positions, num_hits)
        self.num_partial_hits += 1
        return tail

    def can_fit(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        blocks = self.req_to_blocks.get(req.request_id)
        num_have = len(blocks) if blocks else len(computed_blocks)
        num_computed = req.num_computed_tokens if blocks else len(computed_blocks) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - num_have
        # Cached blocks that sit in the free list are taken out of it by touch().
        num_evictable_hits = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        return needed <= self.pool.num_free_blocks - num_evictable_hits

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``req``; None when out of blocks.

        ``computed_blocks`` (first scheduling only) are prefix-cache hits already counted
        in ``req.num_computed_tokens`` by the caller.
        """
        blocks = self.req_to_blocks.get(req.request_id)
        if blocks is not None:  # a running request (the common case: one decode token)
            num_tokens = req.num_computed_tokens + num_new_tokens
            needed = -(-num_tokens // self.block_size) - len(blocks)
            if needed > 0:
                if needed > self.pool.num_free_blocks:
                    return None
                have = len(blocks)
                blocks.extend(self._allocate(needed))
                self._write_row(req.request_id, blocks, have)
            if self.enable_caching and num_tokens // self.block_size > self._num_cached_blocks.get(req.request_id, 0):
                self._cache_full_blocks(req, num_tokens)
            return blocks
        blocks = []
        computed_blocks = computed_blocks or []
        num_computed = req.num_computed_tokens
        tail = self._tails.get(req.request_id)
        use_tail = tail is not None and tail[2] == len(computed_blocks) \
            and num_computed == len(computed_blocks) * self.block_size + tail[1]
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(computed_blocks) - use_tail
        num_evictable_hits = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if needed > self.pool.num_free_blocks - num_evictable_hits:
            return None
        if tail is not None:
            del self._tails[req.request_id]
            if not use_tail:
                self.pool.free([tail[0]])
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self._num_cached_blocks[req.request_id] = len(computed_blocks)
        if use_tail:
            blocks.append(tail[0])
        if needed > 0:
            blocks.extend(self._allocate(needed))
        self.req_to_blocks[req.request_id] = blocks
        self._write_row(req.request_id, blocks, 0)
        if self.enable_caching:
            self._cache_full_blocks(req, num_computed + num_new_tokens)
        return blocks

    def _allocate(self, n: int) -> list[int]:
        blocks = self.pool.allocate(n)
        if self.record is not None:  # to be written: untrusted until committed
            self.record.invalidate(blocks)
        return blocks

    def commit(self, req: Request, num_tokens: int) -> None:
        """A finished forward wrote the request's KV at every position below ``num_tokens``:
        its full blocks there are committed in the record (trusted by a salvage)."""
        record = self.record
        if record is None:
            return
        rid = req.request_id
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        bs = self.block_size
        hashes = req.block_hashes
        n = min(num_tokens // bs, len(blocks), len(hashes))
        done = self._num_committed.get(rid, 0)
        for i in range(done, n):
            record.commit(blocks[i], hashes[i])
        if n > done:
            self._num_committed[rid] = n
        partial = num_tokens - n * bs
        if 0 < partial < bs and n == num_tokens // bs and len(blocks) > n:
            parent = block_parent(hashes, n, req.cache_salt)
            record.commit(blocks[n], hash_partial_block(parent, req.all_token_ids[n * bs:num_tokens]))

    def adopt_tail(self, request_id: str, num_full_blocks: int, num_positions: int, copy) -> bool:
        """A salvage's last block, not full: a free block taken, filled by ``copy(block)``
        (False: it could not be), kept for the request's first allocation, which takes it
        after its ``num_full_blocks`` prefix hits so that ``num_positions`` more of its
        tokens count as computed."""
        if not 0 < num_positions < self.block_size or self.pool.num_free_blocks < 1:
            return False
        self._drop_tail(request_id)
        block = self._allocate(1)[0]
        try:
            ok = copy(block)
        except BaseException:
            self.pool.free([block])
            raise
        if not ok:
            self.pool.free([block])
            return False
        self._tails[request_id] = (block, num_positions, num_full_blocks)
        return True

    def _drop_tail(self, request_id: str) -> None:
        tail = self._tails.pop(request_id, None)
        if tail is not None:
            self.pool.free([tail[0]])

    def import_blocks(self, block_hashes: list[int], copy) -> int:
        """Adopt blocks another engine computed (a salvage): for each of ``block_hashes``
        (a prefix chain not cached here), a free block is taken, ``copy(dst_ids)`` fills
        them and returns how many leading ones it filled, and those are cached here under
        their hashes and committed, then released to the free list (cached, like a
        finished request's blocks) for the request's prefix lookup to hit. Returns the
        number adopted."""
        n = min(len(block_hashes), self.pool.num_free_blocks)
        if not self.enable_caching or n <= 0:
            return 0
        dst = self._allocate(n)
        try:
            done = copy(dst)
            for b, h in zip(dst[:done], block_hashes[:done]):
                self.pool.cache_block(b, h)
                if self.record is not None:
                    self.record.commit(b, h)
        finally:
            self.pool.free(reversed(dst))
        return done

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        # Tokens up to num_tokens are known (prompt or already sampled), so every block
        # they fill can be offered to later requests.
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = hash_request_blocks(req.all_token_ids, self.block_size, req.block_hashes, req.cache_salt)
        blocks = self.req_to_blocks[req.request_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[req.request_id] = num_full

    def free(self, req: Request) -> None:
        self._drop_tail(req.request_id)
        kept = self._kept_tail(req) if self.enable_caching and req.status in _KEEPS_TAIL else None
        blocks = self.req_to_blocks.pop(req.request_id, None)
        self._num_cached_blocks.pop(req.request_id, None)
        self._num_committed.pop(req.request_id, None)
        row = self.table_rows.pop(req.request_id, None)
        if row is not None:
            self.block_table[row, :len(blocks)] = 0
            self._free_rows.append(row)
        if blocks:
            self.pool.free(reversed(blocks))
        if kept is not None:
            self.pool.cache_partial(*kept)

    def _kept_tail(self, req: Request) -> tuple[int, int, list[int]] | None:
        """(block, parent hash, tokens) of a finished request's last block when it is not
        full: its positions below num_computed_tokens hold their KV (the forwards that
        write them run before any later request's)."""
        blocks = self.req_to_blocks.get(req.request_id)
        bs = self.block_size
        computed = min(req.num_computed_tokens, len(req.all_token_ids))
        n = computed // bs
        if not blocks or computed % bs == 0 or len(blocks) <= n:
            return None
        hashes = hash_request_blocks(req.all_token_ids, bs, req.block_hashes, req.cache_salt)
        parent = block_parent(hashes, n, req.cache_salt)
        return blocks[n], parent, req.all_token_ids[n * bs:computed]

    def _write_row(self, request_id: str, blocks: list[int], start: int) -> None:
        """blocks[start:] into the request's row (a new row for a new request)."""
        row = self.table_rows.get(request_id)
        if row is None:
            if not self._free_rows:  # twice the rows
                n = self.block_table.shape[0]
                self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
                self._free_rows.extend(range(2 * n - 1, n - 1, -1))
            row = self.table_rows[request_id] = self._free_rows.pop()
        cols = self.block_table.shape[1]
        if len(blocks) > cols:  # at least twice the columns
            grown = np.zeros((self.block_table.shape[0], max(2 * cols, len(blocks))), dtype=np.int64)
            grown[:, :cols] = self.block_table
            self.block_table = grown
        self.block_table[row, start:len(blocks)] = blocks[start:]

    def decode_table(self, request_ids: list[str], num_blocks: int) -> np.ndarray:
        """[len(request_ids), num_blocks] int64: the first num_blocks blocks of each
        request (0 past its own), a copy."""
        rows = [self.table_rows[r] for r in request_ids]
        return self.block_table[rows, :num_blocks]

    def reset_prefix_cache(self) -> bool:
        for rid in list(self._tails):  # computed with the weights of before
            self._drop_tail(rid)
        if self.record is not None:
            self.record.invalidate_all()
        return self.pool.reset_prefix_cache()

    def take_events(self, max_items: int | None = None) -> CacheEvents | None:
        """The prefix cache's net change since the last call (BlockPool.take_events)."""
        return self.pool.take_events(max_items) if self.enable_caching else None

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.pool.num_cache_queries_blocks
        return self.pool.num_cache_hits_blocks / q if q else 0.0
