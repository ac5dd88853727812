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
