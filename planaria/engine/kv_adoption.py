"""KV blocks an engine takes from another engine's KV segment (engine/kv_segment.py) instead
of computing them: a replay's salvage (its engine died or handed it over), a handover's
pre-copy (``prefetch_kv``) and a balanced request's copy from a live peer of the node (the
router's ``kv_peer``). A mixin of engine/core.py's EngineCore (its KV cache manager,
runner, counters and request checks); docs/kv_salvage.md, docs/routing.md."""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from planaria.engine.kv_segment import SalvageRefused
from planaria.engine.request import Request

log = structlog.get_logger("planaria.engine")


@dataclass
class SalvageStats:
    """Replays that named a segment to salvage from (engine/kv_segment.py), since start."""

    num_requests: int = 0  # replays that asked
    num_refused: int = 0  # segment unusable: recomputed
    num_blocks: int = 0  # blocks adopted (prefetched ones included)
    num_peer_requests: int = 0  # new requests that named a live peer's segment (kv_peer)
    num_peer_blocks: int = 0  # blocks copied from such peers


class KVAdoption:
    def _copy_from_peer(self, req: Request, name: str) -> None:
        """A new request whose prompt a live engine of this node holds more of (the router's
        ``kv_peer``): copy the committed blocks of its prefix this engine lacks from that
        engine's segment into this one's prefix cache, where the request's allocation finds
        them (a node-wide prefix cache). The peer keeps running: a block it reuses during
        the copy fails its seqlock check and is computed here instead."""
        if req.wants_prompt_logprobs:  # takes no cached block: not counted as asking
            return
        t0 = time.perf_counter()
        self.salvage.num_peer_requests += 1
        try:
            adopted = self._adopt_blocks(req, name, tail=False)
        except SalvageRefused as exc:  # another node's engine, gone, other weights: computed
            log.debug("peer KV not used", request_id=req.request_id, segment=name, reason=str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a copy never costs more than the prefill
            log.warning("peer KV copy failed; the prompt is computed", request_id=req.request_id, error=repr(exc))
            return
        self.salvage.num_peer_blocks += adopted
        if adopted:
            log.debug("copied peer KV blocks", request_id=req.request_id, segment=name, blocks=adopted,
                      ms=round(1000 * (time.perf_counter() - t0), 2))

    def _salvage(self, req: Request, name: str) -> None:
        """A replay of a request whose engine died or handed it over: adopt the blocks of
        its prefix that engine committed in its segment (engine/kv_segment.py), so only
        the rest is computed. Anything wrong with the segment: the request is computed
        as a plain replay."""
        t0 = time.perf_counter()
        self.salvage.num_requests += 1
        try:
            adopted = self._adopt_blocks(req, name)
        except SalvageRefused as exc:
            self.salvage.num_refused += 1
            log.info("salvage refused; the request is recomputed", request_id=req.request_id, reason=str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a salvage never costs more than the recompute
            self.salvage.num_refused += 1
            log.warning("salvage failed; the request is recomputed", request_id=req.request_id, error=repr(exc))
            return
        self.salvage.num_blocks += adopted
        log.info("salvaged KV blocks", request_id=req.request_id, segment=name, blocks=adopted,
                 ms=round(1000 * (time.perf_counter() - t0), 2))

    def _adopt_blocks(self, req: Request, name: str, tail: bool = True) -> int:
        """Adopt from segment ``name`` the full blocks of ``req``'s tokens but the last (and,
        with ``tail``, the partly written block after them: a replay's)."""
        from planaria.engine.block_pool import hash_request_blocks

        if req.wants_prompt_logprobs:
            raise SalvageRefused("the request wants prompt logprobs: every position runs through the model")
        hashes = hash_request_blocks(req.all_token_ids, self.kv.block_size, req.block_hashes, req.cache_salt)
        # as get_computed_blocks: one token is left to compute
        return self._adopt(hashes[:(req.num_tokens - 1) // self.kv.block_size], name, req if tail else None)

    def _adopt(self, wanted: list[int], name: str, req: Request | None = None) -> int:
        """Adopt the leading run of the chain ``wanted`` (block hashes) that is not cached
        here from segment ``name``: copied into free blocks, cached under their hashes.
        With ``req`` (a replay; ``wanted`` its full blocks but the last token's), also the
        block after them that the segment holds partly (``_adopt_tail``)."""
        from planaria.engine.kv_segment import SalvageSource, copy_blocks, segment_dir

        seg = self.runner.kv_segment
        directory = segment_dir()
        if seg is None or directory is None or not self.kv.enable_caching:
            raise SalvageRefused("this engine keeps no KV segment")
        i = 0
        while i < len(wanted) and self.kv.pool.lookup(wanted[i]) is not None:
            i += 1  # already cached here
        if i == len(wanted) and (req is None or req.num_tokens - 1 == len(wanted) * self.kv.block_size):
            return 0
        if name == seg.name:
            raise SalvageRefused("the segment is this engine's own")
        src = SalvageSource(directory, name, seg.layout, self.runner.kv_fingerprint(self.kv_identity))
        try:
            run = src.find_run(wanted[i:])

            def copy(dst: list[int]) -> int:
                part = run[:len(dst)]
                copy_blocks(seg.blocks, src, [b for b, _ in part], dst[:len(part)])
                return src.still_valid(part)

            adopted = self.kv.import_blocks(wanted[i:i + len(run)], copy) if run else 0
            if req is not None and i + adopted == len(wanted):
                adopted += self._adopt_tail(req, wanted, src)
            return adopted
        finally:
            src.close()

    def _adopt_tail(self, req: Request, wanted: list[int], src) -> int:
        """The block after the full ones ``wanted``, when the segment committed some of its
        positions (KVCacheManager.commit: the hash of those tokens): copied into a block the
        request's first allocation takes, so it computes only from the first position the
        copy lacks (the last token, after a kill in decode) instead of the whole block.
        The segment may hold one position more than the replay's tokens leave to trust
        (the output of its last step was lost with it): that position is computed again."""
        from planaria.engine.block_pool import block_parent, hash_partial_block
        from planaria.engine.kv_segment import copy_blocks

        bs = self.kv.block_size
        num_full = len(wanted)
        tokens = req.all_token_ids[num_full * bs:]
        trusted = req.num_tokens - 1 - num_full * bs  # positions a computation would skip
        parent = block_parent(wanted, len(wanted), req.cache_salt)
        for m in range(min(len(tokens), bs - 1), 0, -1):
            hit = src.find(hash_partial_block(parent, tokens[:m]))
            if hit is not None:
                break
        else:
            return 0
        seg = self.runner.kv_segment

        def copy(block: int) -> bool:
            copy_blocks(seg.blocks, src, [hit[0]], [block])
            return src.still_valid([hit]) == 1

        return int(self.kv.adopt_tail(req.request_id, num_full, min(m, trusted), copy))

    def prefetch_kv(self, segment: str, token_ids: list[int], cache_salt: str | None = None) -> int:
        """The bulk of a handover, copied while the draining engine still decodes: adopt the
        committed blocks of ``token_ids`` (a request's prompt and output so far, with its
        salt) from ``segment`` into this engine's prefix cache, where the request's move
        finds them; only the blocks committed after this are copied then. Returns the
        number of blocks adopted; a segment that cannot be used adopts none."""
        from planaria.engine.block_pool import hash_request_blocks

        from planaria.engine.kv_transfer import check_tokens

        if not isinstance(segment, str) or len(segment) > 64:
            raise ValueError("segment must be a segment name")
        check_tokens(self, token_ids, cache_salt)
        try:
            adopted = self._adopt(hash_request_blocks(token_ids, self.kv.block_size, [], cache_salt), segment)
        except SalvageRefused as exc:
            log.info("prefetch refused", segment=segment, reason=str(exc))
            return 0
        self.salvage.num_blocks += adopted
        return adopted
