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


def test_a_balanced_request_names_the_engine_holding_its_prefix():
    """BALANCE: the chosen engine may copy the prefix from the least loaded holder (peer);
    PREFIX and NO_PREFIX name none."""
    route = decide(KV, [c(0, 12, 60), c(1, 9, 60), c(2, 3, 0)], 1000, BS)
    assert (route.index, route.reason, route.peer) == (2, RouteReason.BALANCE, 1)
    assert decide(KV, [c(0, 5, 60), c(1, 2, 0)], 1000, BS).peer is None
    assert decide(KV, [c(0, 3), c(1, 1)], 700, BS).peer is None


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


# -- shared vs private prefixes (Router remembers the prefixes it routed lately) ---------------
class _Index:
    def __init__(self, held: list[int]) -> None:
        self.held = held

    def num_matched(self, hashes: list[int]) -> int:
        n = 0
        for h, mine in zip(hashes, self.held):
            if h != mine:
                break
            n += 1
        return n


class _Engine:
    def __init__(self, index: int, load: int, held: list[int]) -> None:
        self.index, self.load, self.stats, self.prefix = index, load, None, _Index(held)


def _request(prompt_len: int):
    from planaria.engine.messages import EngineCoreRequest
    from planaria.engine.sampling_params import SamplingParams

    return EngineCoreRequest(request_id="r", prompt_token_ids=list(range(prompt_len)),
                             sampling_params=SamplingParams(max_tokens=4))


def test_a_private_prefix_keeps_a_busier_engine_a_shared_one_spreads():
    """Engine 0 holds 40 blocks of a prompt, with 10 requests against engine 1's 3: past the
    shared bound (3 + 4), within the private one (3 + 16). The first request matching that
    prefix stays (a conversation's history); once requests routed lately shared the same
    matched block it is a hot prefix and spreads; some half-lives later it is private again."""
    from planaria.engine.kv_router import SHARED_HALF_LIFE_S, Router, prompt_hashes

    now = [100.0]
    router = Router(RoutingPolicy.KV, clock=lambda: now[0])
    request = _request(700)
    hashes = prompt_hashes(request, BS)
    engines = [_Engine(0, 10, hashes[:40]), _Engine(1, 3, hashes[:4])]
    first = router.route(engines, request, None, BS)
    assert (first.index, first.reason, first.num_matched_blocks) == (0, RouteReason.PREFIX, 40)
    router.count(first)
    second = router.route(engines, request, None, BS)
    assert (second.index, second.reason) == (1, RouteReason.BALANCE)
    router.count(second)  # its match (4 blocks) is another prefix: the 40th block still shared
    assert router.route(engines, request, None, BS).index == 1
    now[0] += 4 * SHARED_HALF_LIFE_S
    assert router.route(engines, request, None, BS).index == 0
    # an engine past even the private bound spreads it too
    engines[0].load = 3 + 17
    assert router.route(engines, request, None, BS).index == 1


def test_routers_memory_of_prefixes_is_bounded():
    from planaria.engine.kv_router import RECENT_MAX, Route, Router

    router = Router(RoutingPolicy.KV)
    for i in range(RECENT_MAX + 10):
        router.count(Route(0, RouteReason.PREFIX, 1, [i]))
    assert len(router._recent) == RECENT_MAX
