"""The frontend's PrefixIndex follows an engine's prefix cache exactly: a property test
that drives a real KVCacheManager (block pool, LRU eviction, resets) with random requests
and applies the pool's events, batch by batch, to an index; after every batch the index
holds exactly the pool's cached hashes. Also: snapshots after an overflow, gaps, bounds,
and the cache salt (the engine's cache and the router's hashes never cross salts)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planaria.engine.block_pool import NONE_HASH, BlockPool, chain_root, hash_request_blocks
from planaria.engine.kv_cache_manager import KVCacheManager
from planaria.engine.messages import EngineCoreRequest, KVCacheEvents
from planaria.engine.kv_router import prompt_hashes
from planaria.engine.prefix_index import PrefixIndex
from planaria.engine.request import Request
from planaria.engine.sampling_params import SamplingParams

BLOCK = 4
BASES = [[100 + i for i in range(40)], [200 + i for i in range(40)], [100 + i for i in range(12)] + [7] * 28]


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64), None, 64, cache_salt=salt)


class _Feed:
    """The engine process's side: numbered batches of the pool's events."""

    def __init__(self, kv: KVCacheManager, max_items: int | None = None) -> None:
        self.kv, self.max_items, self.seq = kv, max_items, 0

    def take(self) -> KVCacheEvents | None:
        events = self.kv.take_events(self.max_items)
        if events is None:
            return None
        self.seq += 1
        return KVCacheEvents(seq=self.seq, cleared=events.cleared, stored=events.stored, removed=events.removed)


def _admit(kv: KVCacheManager, req: Request) -> bool:
    """As the scheduler admits a request: prefix hits, then slots for the rest."""
    hits, num_computed = kv.get_computed_blocks(req)
    req.num_computed_tokens = num_computed
    if kv.allocate_slots(req, req.num_tokens - num_computed, hits) is None:
        req.num_computed_tokens = 0
        return False
    req.num_computed_tokens = req.num_tokens
    return True


def _run(ops, num_blocks: int, max_pending: int | None, max_items: int | None) -> None:
    kv = KVCacheManager(num_blocks, BLOCK)
    if max_pending is not None:
        kv.pool.max_pending_events = max_pending
    feed, index = _Feed(kv, max_items), PrefixIndex()
    running: list[Request] = []
    for n, op in enumerate(ops):
        kind = op[0]
        if kind == "add":
            _, base, length, salt = op
            req = _req(f"r{n}", BASES[base][:length] + [900 + n], salt)
            if _admit(kv, req):
                running.append(req)
            if len(running) > 3:  # finished: its blocks stay cached until evicted
                kv.free(running.pop(0))
        elif kind == "grow" and running:
            req = running[op[1] % len(running)]
            for t in range(op[2]):
                req.append_output_token(500 + t)
            if kv.allocate_slots(req, op[2]) is not None:
                req.num_computed_tokens += op[2]
        elif kind == "free" and running:
            kv.free(running.pop(op[1] % len(running)))
        elif kind == "reset":
            kv.reset_prefix_cache()
        elif kind == "take":
            events = feed.take()
            if events is not None:
                index.apply(events)
                assert index.hashes() == set(kv.pool.cached_hashes())
    events = feed.take()
    if events is not None:
        index.apply(events)
    assert index.hashes() == set(kv.pool.cached_hashes())
    assert index.num_gaps == 0


_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 40), st.sampled_from([None, None, "a", "b"])),
    st.tuples(st.just("grow"), st.integers(0, 50), st.integers(1, 9)),
    st.tuples(st.just("free"), st.integers(0, 50)),
    st.tuples(st.just("reset")),
    st.tuples(st.just("take")),
), max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops=_OPS, num_blocks=st.integers(4, 24))
def test_index_holds_exactly_the_pools_cached_blocks(ops, num_blocks):
    _run(ops, num_blocks, None, None)


@settings(max_examples=200, deadline=None)
@given(ops=_OPS, num_blocks=st.integers(4, 40), max_pending=st.integers(1, 6), max_items=st.integers(1, 8))
def test_overflowing_changes_become_a_snapshot_and_the_index_stays_exact(ops, num_blocks, max_pending, max_items):
    """Few pending changes allowed and small batches: snapshots ("cleared" + every cached
    hash, at most max_items of them) keep it exact whenever the pool caches no more."""
    kv = KVCacheManager(num_blocks, BLOCK)
    kv.pool.max_pending_events = max_pending
    feed, index = _Feed(kv, max_items), PrefixIndex()
    running: list[Request] = []
    for n, op in enumerate(ops):
        if op[0] == "add" and _admit(kv, req := _req(f"r{n}", BASES[op[1]][:op[2]] + [900 + n], op[3])):
            running.append(req)
        elif op[0] == "free" and running:
            kv.free(running.pop(op[1] % len(running)))
        events = feed.take()
        if events is not None:
            assert len(events.stored) <= max_items and len(events.removed) <= max_items
            index.apply(events)
            cached = set(kv.pool.cached_hashes())
            if len(cached) <= max_items:
                assert index.hashes() == cached
            else:
                assert index.hashes() <= cached


def test_a_pool_reports_nothing_when_nothing_changed_and_a_reset_as_cleared():
    kv = KVCacheManager(8, BLOCK)
    assert kv.take_events() is None
    req = _req("a", list(range(9)))
    assert _admit(kv, req)
    events = kv.take_events()
    assert events.stored == hash_request_blocks(req.all_token_ids, BLOCK, []) and not events.removed
    assert kv.take_events() is None
    kv.free(req)
    assert kv.take_events() is None  # freed blocks stay cached until evicted
    assert kv.reset_prefix_cache()
    events = kv.take_events()
    assert events.cleared and events.stored == []


def test_a_gap_in_the_numbers_empties_the_index():
    index = PrefixIndex()
    index.apply(KVCacheEvents(seq=1, stored=[1, 2, 3]))
    index.apply(KVCacheEvents(seq=3, stored=[4]))  # batch 2 lost: 1, 2, 3 may be gone
    assert index.hashes() == {4} and index.num_gaps == 1
    index.apply(KVCacheEvents(seq=4, removed=[4], stored=[5]))
    assert index.hashes() == {5}


def test_the_index_is_bounded_and_drops_the_oldest():
    index = PrefixIndex(max_blocks=3)
    index.apply(KVCacheEvents(seq=1, stored=[1, 2, 3, 4, 5]))
    assert index.hashes() == {3, 4, 5} and index.num_dropped_blocks == 2
    index.limit(2)
    assert index.hashes() == {4, 5}
    assert index.num_matched([4, 5, 6]) == 2 and index.num_matched([3, 4]) == 0


def test_router_hashes_are_the_engines_hashes():
    """The frontend hashes an EngineCoreRequest as the engine hashes its Request."""
    ids = [random.Random(1).randrange(50000) for _ in range(70)]
    for salt in (None, "tenant-a"):
        ecr = EngineCoreRequest(request_id="x", prompt_token_ids=ids, sampling_params=SamplingParams(),
                                cache_salt=salt)
        kv = KVCacheManager(32, 16)
        req = _req("x", ids, salt)
        assert _admit(kv, req)
        assert prompt_hashes(ecr, 16) == req.block_hashes == kv.take_events().stored
    assert prompt_hashes(EngineCoreRequest(request_id="y", prompt_token_ids=[2**40] * 32,
                                           sampling_params=SamplingParams()), 16) == []  # not int32: no hint


@pytest.mark.parametrize("first, second", [(None, "a"), ("a", "b"), ("a", None)])
def test_a_salted_request_never_hits_another_salts_blocks(first, second):
    kv = KVCacheManager(32, BLOCK)
    prompt = list(range(30))
    a = _req("a", prompt, first)
    assert _admit(kv, a)
    kv.free(a)
    b = _req("b", prompt + [99], second)
    assert kv.get_computed_blocks(b) == ([], 0)  # the engine's own cache: no hit across salts
    same = _req("c", prompt + [99], first)
    assert kv.get_computed_blocks(same)[1] == 28  # the same salt hits
    index = PrefixIndex()
    index.apply(KVCacheEvents(seq=1, stored=kv.pool.cached_hashes()))
    assert index.num_matched(hash_request_blocks(prompt, BLOCK, [], second)) == 0  # nor in routing
    assert index.num_matched(hash_request_blocks(prompt, BLOCK, [], first)) == 7


def test_chain_roots_differ_by_salt_and_none_is_the_unsalted_root():
    assert chain_root(None) == chain_root("") == NONE_HASH
    assert len({chain_root("a"), chain_root("b"), chain_root("ab"), NONE_HASH}) == 4


def test_a_pool_without_caching_reports_nothing():
    kv = KVCacheManager(8, BLOCK, enable_caching=False)
    assert _admit(kv, _req("a", list(range(9))))
    assert kv.take_events() is None
    assert BlockPool(4).take_events() is None


def test_a_batch_past_the_bound_is_refused_at_decode():
    """Every byte from an engine is hostile: a frontend decodes at most MAX_KV_EVENT_HASHES
    hashes per list, and no negative ones."""
    from planaria.engine.errors import WireFormatError
    from planaria.engine.messages import MAX_KV_EVENT_HASHES, EngineCoreOutputs
    from planaria.engine.wire import FRONTEND_INPUT_TYPES, MsgType, WireDecoder, WireEncoder

    enc, dec = WireEncoder(reuse_buffer=False), WireDecoder(FRONTEND_INPUT_TYPES)
    ok = EngineCoreOutputs(kv_events=KVCacheEvents(seq=1, stored=[2**64 - 1] * MAX_KV_EVENT_HASHES))
    assert dec.decode(enc.encode(MsgType.OUTPUTS, ok))[1].kv_events.stored[0] == 2**64 - 1
    for bad in (KVCacheEvents(seq=1, stored=[1] * (MAX_KV_EVENT_HASHES + 1)),
                KVCacheEvents(seq=1, removed=[1] * (MAX_KV_EVENT_HASHES + 1)),
                KVCacheEvents(seq=1, stored=[-1])):
        with pytest.raises(WireFormatError):
            dec.decode(enc.encode(MsgType.OUTPUTS, EngineCoreOutputs(kv_events=bad)))
