"""engine/kv_router.py: the routing decision, table-driven (no sockets, no engines)."""

from __future__ import annotations

import pytest

from planaria.engine.kv_router import Candidate, RouteReason, RouteWeights, RoutingPolicy, decide

KV, LL = RoutingPolicy.KV, RoutingPolicy.LEAST_LOADED
BS = 16


def c(index, load=0, matched=0, kv=0.0):
    return Candidate(index, load, kv, matched)


@pytest.mark.parametrize("policy, candidates, prompt_tokens, want, reason", [
    # the engine holding the conversation's history wins at equal load
    (KV, [c(0, 5, 4), c(1, 5, 40)], 700, 1, RouteReason.PREFIX),
    # ... and at a little more load
    (KV, [c(0, 3, 4), c(1, 6, 40)], 700, 1, RouteReason.PREFIX),
    # no prefix anywhere: the least loaded
    (KV, [c(0, 3), c(1, 1), c(2, 2)], 700, 1, RouteReason.NO_PREFIX),
    # a hot prefix on a busy engine: past the imbalance bound it spills to the idle one
    (KV, [c(0, 9, 60), c(1, 4, 0)], 1000, 1, RouteReason.BALANCE),
    # a full KV cache takes no request for its prefix's sake
    (KV, [c(0, 2, 60, kv=0.97), c(1, 2, 0)], 1000, 1, RouteReason.BALANCE),
    # ... unless every engine is full
    (KV, [c(0, 2, 60, kv=0.97), c(1, 2, 0, kv=0.99)], 1000, 0, RouteReason.PREFIX),
    # equal prefixes: the load decides, and it is still the longest prefix
    (KV, [c(0, 5, 60), c(1, 2, 60)], 1000, 1, RouteReason.PREFIX),
    # a small prefix does not outweigh much more load
    (KV, [c(0, 4, 5), c(1, 0, 0)], 1000, 1, RouteReason.BALANCE),
    # a prefix under min_match_tokens (a chat template's header) counts as none
    (KV, [c(0, 0, 3), c(1, 0, 0)], 1000, 0, RouteReason.NO_PREFIX),
    (KV, [c(0, 1, 3), c(1, 0, 0)], 1000, 1, RouteReason.NO_PREFIX),
    (KV, [c(0, 0, 4), c(1, 0, 0)], 1000, 0, RouteReason.PREFIX),
    # least-loaded ignores prefixes
    (LL, [c(0, 1, 60), c(1, 0, 0)], 1000, 1, RouteReason.LEAST_LOADED),
])
def test_decide(policy, candidates, prompt_tokens, want, reason):
    route = decide(policy, candidates, prompt_tokens, BS)
    assert (route.index, route.reason) == (want, reason)


def test_ties_are_taken_in_turn():
    cands = [c(0), c(1), c(2)]
    assert [decide(KV, cands, 64, BS, turn).index for turn in range(6)] == [0, 1, 2, 0, 1, 2]
    held = [c(0, matched=8), c(1, matched=8), c(2, matched=8)]  # equal prefixes, equal loads
    assert [decide(KV, held, 200, BS, turn).index for turn in range(3)] == [0, 1, 2]
    assert [decide(LL, cands, 64, BS, turn).index for turn in range(3)] == [0, 1, 2]


def test_a_hot_prefix_spreads_once_its_engine_is_busy():
    """Every request shares a 1k-token prefix only engine 0 holds: engine 0 takes them until
    it has imbalance_abs more than engine 1; engine 1 then gets one (and caches the prefix)."""
    w = RouteWeights()
    loads = [0, 0]
    picks = []
    for turn in range(12):
        route = decide(KV, [c(0, loads[0], 64), c(1, loads[1], 0)], 1030, BS, turn, w)
        loads[route.index] += 1
        picks.append(route.index)
        if route.index == 1:
            break
    assert picks == [0] * (w.imbalance_abs + 1) + [1]


def test_no_candidate_is_an_error():
    with pytest.raises(ValueError):
        decide(KV, [], 10, BS)
