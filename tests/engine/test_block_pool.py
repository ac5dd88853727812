import pytest

from planaria.engine.block_pool import NONE_HASH, BlockPool, hash_block_tokens, hash_request_blocks
from planaria.engine.kv_cache_manager import KVCacheManager
from planaria.engine.request import Request
from planaria.engine.sampling_params import SamplingParams


def make_req(rid, tokens, max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), eos_token_id=None, max_tokens=max_tokens)


def test_hash_chain_is_deterministic_and_chained():
    a = hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert a == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    # The same tokens under a different parent hash differently.
    assert hash_block_tokens(a, [1, 2, 3, 4]) != a
    hs = hash_request_blocks(list(range(10)), 4, [])
    assert len(hs) == 2  # only full blocks
    assert hash_request_blocks(list(range(12)), 4, hs[:]) [:2] == hs


def test_hash_stable_across_processes():
    import subprocess
    import sys

    code = "from planaria.engine.block_pool import hash_block_tokens, NONE_HASH; print(hash_block_tokens(NONE_HASH, [5, 6, 7]))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert outs == {f"{hash_block_tokens(NONE_HASH, [5, 6, 7])}\n"}


def test_refcounts_and_lru_eviction_order():
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.allocate(1)
    pool.cache_block(a[0], 111)
    pool.cache_block(a[1], 222)
    pool.free(reversed(a))  # tail first -> a[1] evicted before a[0]
    assert pool.lookup(111) == a[0] and pool.lookup(222) == a[1]
    got = pool.allocate(1)
    assert got == [a[1]]
    assert pool.lookup(222) is None and pool.lookup(111) == a[0]
    pool.touch([a[0]])  # prefix hit revives a free cached block
    assert pool.ref_cnt[a[0]] == 1 and pool.num_free_blocks == 0
    pool.free([a[0]])
    pool.free(b)
    assert pool.num_free_blocks == 3 and pool.usage == pytest.approx(0.25)


def test_shared_block_needs_all_refs_dropped():
    pool = BlockPool(2)
    [x] = pool.allocate(1)
    pool.cache_block(x, 7)
    pool.touch([x])
    pool.free([x])
    assert pool.num_free_blocks == 1  # still referenced once
    pool.free([x])
    assert pool.num_free_blocks == 2


def test_prefix_cache_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_req("a", range(12))
    a.num_computed_tokens = 0
    assert kv.allocate_slots(a, 12) is not None
    a.num_computed_tokens = 12
    kv.free(a)
    # Same 12-token prompt: only 2 of 3 blocks may be hits (one token must be computed).
    b = make_req("b", range(12))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and len(hits) == 2
    # Longer prompt sharing the prefix: all 3 blocks hit.
    c = make_req("c", list(range(12)) + [99, 98])
    hits, n = kv.get_computed_blocks(c)
    assert n == 12
    c.num_computed_tokens = n
    blocks = kv.allocate_slots(c, 2, hits)
    assert blocks[:3] == hits and len(blocks) == 4
    # A different prefix does not hit.
    d = make_req("d", [7] + list(range(1, 12)))
    assert kv.get_computed_blocks(d)[1] == 0


def test_allocate_returns_none_when_full_and_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_req("a", range(8))
    assert kv.allocate_slots(a, 8) is not None
    b = make_req("b", range(100, 104))
    assert kv.allocate_slots(b, 4) is None
    assert kv.pool.num_free_blocks == 0 and "b" not in kv.req_to_blocks


def _finish(kv, req, num_out_tokens=1, status=None):
    """Run ``req``'s prompt (all of it computed) and sample ``num_out_tokens`` tokens (the
    last one not computed), as the scheduler does, then end it with ``status``."""
    from planaria.engine.request import RequestStatus

    hits, num_computed = kv.get_computed_blocks(req)
    req.num_computed_tokens = num_computed
    assert kv.allocate_slots(req, req.num_tokens - num_computed, hits) is not None
    req.num_computed_tokens = req.num_tokens
    for i in range(num_out_tokens):
        req.all_token_ids.append(900 + i)
        if i < num_out_tokens - 1:
            assert kv.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
    req.status = status or RequestStatus.FINISHED_STOPPED
    kv.free(req)


def test_a_finished_requests_last_block_is_taken_over_by_its_follow_up():
    """A's last block (not full) stays cached under its positions; B, which continues A's
    prompt and reply, takes it over after A's full blocks and computes from where A's KV
    ends; nobody else can have it then (B writes the rest of it)."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_req("a", range(1, 9))  # 8 prompt tokens: two full blocks
    _finish(kv, a, num_out_tokens=3)  # computed: 8 + 2 = 10 positions, the third block holds 2
    assert kv.pool.num_partial_blocks == 1
    follow = list(a.all_token_ids) + [50, 51, 52]  # A's prompt, its reply (3 tokens), a new message
    b = make_req("b", follow)
    hits, num_computed = kv.get_computed_blocks(b)
    assert len(hits) == 2 and num_computed == 10 and kv.num_partial_hits == 1
    b.num_computed_tokens = num_computed
    blocks = kv.allocate_slots(b, b.num_tokens - num_computed, hits)
    assert blocks[:2] == hits and len(blocks) == 4 and kv.pool.ref_cnt[blocks[2]] == 1
    assert kv.pool.num_partial_blocks == 0  # B's own now
    c = make_req("c", follow)  # the same tokens again: B's third block, full and cached as B was scheduled
    assert kv.get_computed_blocks(c) == (blocks[:3], 12) and kv.num_partial_hits == 1


def test_a_kept_last_block_needs_the_same_tokens_and_salt_and_is_evicted_like_any_free_block():
    from planaria.engine.request import RequestStatus

    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", range(1, 9))
    _finish(kv, a, num_out_tokens=3)
    other = make_req("x", list(a.all_token_ids[:9]) + [77, 5, 6])  # position 9 differs
    assert kv.get_computed_blocks(other)[1] == 8
    shorter = make_req("s", list(a.all_token_ids[:9]) + [77])  # agrees on position 8 only: not the kept length
    assert kv.get_computed_blocks(shorter)[1] == 8
    salted = Request("t", list(a.all_token_ids) + [5], SamplingParams(max_tokens=4), eos_token_id=None,
                     max_tokens=4, cache_salt="tenant")
    assert kv.get_computed_blocks(salted) == ([], 0)
    assert kv.pool.num_partial_blocks == 1
    # no token left to compute after it: not taken (the prompt's last token must run)
    exact = make_req("e", list(a.all_token_ids[:10]))
    assert kv.get_computed_blocks(exact)[1] == 8 and kv.pool.num_partial_blocks == 1
    kv.pool.allocate(kv.pool.num_free_blocks)  # every free block reused: the kept one too
    assert kv.pool.num_partial_blocks == 0

    kv = KVCacheManager(num_blocks=8, block_size=4)
    aborted = make_req("a", range(1, 9))
    _finish(kv, aborted, num_out_tokens=3, status=RequestStatus.FINISHED_ABORTED)
    assert kv.pool.num_partial_blocks == 0  # only a request that ended by itself keeps it
    full = make_req("f", range(1, 9))
    _finish(kv, full, num_out_tokens=1)  # 8 positions computed: nothing partial
    assert kv.pool.num_partial_blocks == 0
    kept = make_req("k", range(1, 7))
    _finish(kv, kept, num_out_tokens=2)
    assert kv.pool.num_partial_blocks == 1
    assert kv.reset_prefix_cache() and kv.pool.num_partial_blocks == 0
