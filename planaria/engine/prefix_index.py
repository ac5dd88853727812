"""PrefixIndex: the KV blocks one engine incarnation holds in its prefix cache, as a
frontend learns them from the engine's KVCacheEvents (engine/messages.py). Pure Python.

The engine's block pool reports the net change of its cache once per step (hashes stored,
hashes evicted, or "cleared" and a snapshot; engine/block_pool.py), numbered from 1 per
process. The index applies them in order, so it holds exactly the engine's cached hashes
(tests/engine/test_prefix_index.py checks it against a real pool); a gap in the numbers
(a message lost or refused) empties it, as it can no longer be trusted to be exact, and
it fills again from later stores.

It is a routing hint and nothing more: the engine's own cache decides every hit, so an
index that is wrong costs a prefill, never a wrong token. Every byte of an event comes from
another process, so the index is bounded: at most ``max_blocks`` hashes (the engine's
block count, at most MAX_INDEX_BLOCKS), the oldest stored dropped first on overflow.

A new engine process gets a new index (EngineInfo in engine/client.py replaces it whole
at the new process's HELLO); a dead, drained or departed engine's is emptied at once.

    index = PrefixIndex(max_blocks=4096)
    index.apply(events)                 # each KVCacheEvents of this engine, in order
    index.num_matched(hashes)           # leading blocks of a request it holds: O(blocks)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

MAX_INDEX_BLOCKS = 1 << 18  # per engine: about 30 MB of Python ints at most


class PrefixIndex:
    def __init__(self, max_blocks: int = MAX_INDEX_BLOCKS) -> None:
        self.max_blocks = max(1, min(max_blocks, MAX_INDEX_BLOCKS))
        self._blocks: OrderedDict[int, None] = OrderedDict()  # oldest stored first
        self.last_seq = 0
        self.num_gaps = 0  # batches missed (the index was emptied each time)
        self.num_dropped_blocks = 0  # hashes let go because the index was full

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def hashes(self) -> set[int]:
        return set(self._blocks)

    def limit(self, max_blocks: int) -> None:
        """Hold at most ``max_blocks`` (the engine's KV block count, once it said it)."""
        self.max_blocks = max(1, min(max_blocks, MAX_INDEX_BLOCKS))
        self._trim()

    def clear(self) -> None:
        self._blocks.clear()

    def apply(self, events) -> None:
        """One KVCacheEvents batch (``seq``, ``cleared``, ``stored``, ``removed``)."""
        if events.seq != self.last_seq + 1:
            self.num_gaps += 1
            self._blocks.clear()  # what happened in between is not known
        self.last_seq = events.seq
        blocks = self._blocks
        if events.cleared:
            blocks.clear()
        for h in events.removed:
            blocks.pop(h, None)
        for h in events.stored:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        self._trim()

    def num_matched(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a request's chained block hashes, in order) it holds
        before the first it does not: the request's cached prefix, in blocks."""
        blocks = self._blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def _trim(self) -> None:
        blocks = self._blocks
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
            self.num_dropped_blocks += 1
