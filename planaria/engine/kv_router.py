"""Which engine a new request goes to: the decision, apart from the client that acts on it.
Pure Python (no sockets, no asyncio); engine/client.py builds the candidates and sends.

Two policies (``planaria serve --routing``):

- ``kv`` (default): the engine that already holds the longest prefix of the request's
  prompt in its KV cache (the frontend's per-engine PrefixIndex, fed by the engines' KV
  events), weighed against the engines' load so that a hot prefix does not pile every
  request onto one engine. Cost of an engine, in tokens of work::

      (prompt tokens - cached prefix tokens) + load_tokens x (requests on it)

  over the engines that are not overloaded: an engine with more than ``imbalance_abs``
  requests and ``imbalance_rel`` times more than the least loaded one (or whose KV cache
  is ``kv_full``) takes no request for its prefix's sake, only when nothing else can.
  That bound is for a *shared* prefix (a system prompt other requests routed lately also
  matched up to the same block): caching it on a second engine once serves all of them, so
  it spreads early. A prefix no recent request shared (a conversation's own history) is
  worth a longer queue, up to ``private_imbalance_abs`` / ``private_imbalance_rel``: its
  recomputation elsewhere is paid again for every conversation that moves.
  A request no engine holds a prefix of goes to the least loaded engine, as with
  ``least-loaded``; so does one whose longest cached prefix is shorter than
  ``min_match_tokens`` (a chat template's few shared tokens are not worth any imbalance),
  and one that asks for prompt logprobs (it runs every prompt position anyway).
- ``least-loaded``: the engine with the fewest requests (running, waiting and in flight
  from this frontend), ties taken in turn.

Every decision has a reason, counted in /metrics (``planaria_routing_decisions_total``):
``prefix`` (the engine holding the longest prefix), ``balance`` (a longer prefix was
elsewhere, on an engine too busy), ``no_prefix`` (no engine holds any), ``least_loaded``
(the policy), ``group`` (an n > 1 sibling follows its group; decided by the client).
"""

from __future__ import annotations

import itertools
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from planaria.engine.block_pool import hash_request_blocks
from planaria.engine.messages import EngineCoreRequest


# A prefix is "shared" once this many requests routed lately (a count halved every
# SHARED_HALF_LIFE_S) matched up to its last block; at most RECENT_MAX such blocks kept.
SHARED_MIN = 1.0
SHARED_HALF_LIFE_S = 10.0
RECENT_MAX = 4096


class RoutingPolicy(StrEnum):
    KV = "kv"
    LEAST_LOADED = "least-loaded"


class RouteReason(StrEnum):
    PREFIX = "prefix"
    BALANCE = "balance"
    NO_PREFIX = "no_prefix"
    LEAST_LOADED = "least_loaded"
    GROUP = "group"


@dataclass(frozen=True)
class Candidate:
    """One running engine as the router sees it."""

    index: int
    load: int  # requests on it: running + waiting (its last stats) + this frontend's in flight
    kv_usage: float = 0.0  # fraction of its KV blocks in use
    num_matched_blocks: int = 0  # leading blocks of the prompt in its prefix cache (PrefixIndex)


@dataclass(frozen=True)
class RouteWeights:
    # a request already on an engine weighs as much as prefilling this many tokens there
    load_tokens: float = 32.0
    # overloaded: more than imbalance_abs requests and imbalance_rel x more than the least loaded
    imbalance_abs: int = 4
    imbalance_rel: float = 0.5
    # the same for a prefix no request routed lately shared (a conversation's history)
    private_imbalance_abs: int = 16
    private_imbalance_rel: float = 1.0
    kv_full: float = 0.95  # KV use at which an engine would preempt to take more
    min_match_tokens: int = 64  # a shorter cached prefix counts as none


@dataclass(frozen=True)
class Route:
    index: int
    reason: RouteReason
    num_matched_blocks: int = 0
    # the prompt's block hashes, when computed for this decision (kept for a retry)
    hashes: list[int] | None = field(default=None, compare=False, repr=False)
    # BALANCE: an engine holding the longest prefix (the chosen one may copy it from there)
    peer: int | None = None


def decide(policy: RoutingPolicy, candidates: Sequence[Candidate], num_prompt_tokens: int, block_size: int,
           turn: int = 0, weights: RouteWeights = RouteWeights(), shared: bool = True) -> Route:
    """The engine for one request among ``candidates`` (not empty); ``turn`` rotates ties
    (pass a counter), so equal engines take requests in turn; ``shared``: other requests
    routed lately matched the longest cached prefix too (the tight imbalance bound)."""
    if not candidates:
        raise ValueError("no candidate engine")
    n = len(candidates)

    def rotation(position: int) -> int:
        return (position - turn) % n

    positions = {c.index: i for i, c in enumerate(candidates)}
    least = min(candidates, key=lambda c: (c.load, rotation(positions[c.index])))
    best_match = max(c.num_matched_blocks for c in candidates)
    if policy is RoutingPolicy.LEAST_LOADED:
        return Route(least.index, RouteReason.LEAST_LOADED, least.num_matched_blocks)
    if best_match * block_size < weights.min_match_tokens:
        return Route(least.index, RouteReason.NO_PREFIX)
    if shared:
        limit = least.load + max(weights.imbalance_abs, weights.imbalance_rel * least.load)
    else:
        limit = least.load + max(weights.private_imbalance_abs, weights.private_imbalance_rel * least.load)
    eligible = [c for c in candidates if c.load <= limit and c.kv_usage < weights.kv_full] or \
               [c for c in candidates if c.load <= limit]

    def cost(c: Candidate) -> tuple:
        uncached = max(0, num_prompt_tokens - c.num_matched_blocks * block_size)
        return (uncached + weights.load_tokens * c.load, c.load, rotation(positions[c.index]))

    chosen = min(eligible, key=cost)
    if chosen.num_matched_blocks == best_match:
        return Route(chosen.index, RouteReason.PREFIX, chosen.num_matched_blocks)
    holder = min((c for c in candidates if c.num_matched_blocks == best_match),
                 key=lambda c: (c.load, rotation(positions[c.index])))
    return Route(chosen.index, RouteReason.BALANCE, chosen.num_matched_blocks, peer=holder.index)


class RoutedEngine(Protocol):
    """What the router reads of an engine (engine/client.py EngineInfo)."""

    index: int
    state: Any
    stats: Any  # SchedulerStats | None
    prefix: Any  # PrefixIndex
    num_routed: int
    num_routed_prompt_tokens: int
    num_routed_cached_tokens: int
    num_routed_while_down: int

    @property
    def load(self) -> int: ...

    @property
    def routed_hit_rate(self) -> float: ...


class Router:
    """A client's routing: the policy, its weights, the decisions by reason and the turn
    that breaks ties. The client hands it the running engines and acts on its Route."""

    def __init__(self, policy: RoutingPolicy = RoutingPolicy.KV, weights: RouteWeights = RouteWeights(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.weights = weights
        self.decisions: dict[str, int] = {r.value: 0 for r in RouteReason}
        self._turn = itertools.count()
        self._clock = clock
        # the last matched block's hash of requests routed lately -> (decayed count, when)
        self._recent: OrderedDict[int, tuple[float, float]] = OrderedDict()

    def route(self, running: Sequence[RoutedEngine], request: EngineCoreRequest, hashes: list[int] | None,
              block_size: int) -> Route:
        """The engine among ``running`` (not empty) for ``request``; ``hashes`` its prompt's
        block hashes if already computed (a retry), else computed here when they can matter."""
        if hashes is None and self.policy is RoutingPolicy.KV and len(running) > 1:
            hashes = prompt_hashes(request, block_size)
        candidates = [Candidate(e.index, e.load, e.stats.kv_usage if e.stats else 0.0,
                                e.prefix.num_matched(hashes) if hashes else 0) for e in running]
        best = max(c.num_matched_blocks for c in candidates)
        shared = best > 0 and self._sharers(hashes[best - 1]) >= SHARED_MIN
        route = decide(self.policy, candidates, len(request.prompt_token_ids), block_size, next(self._turn),
                       self.weights, shared)
        return Route(route.index, route.reason, route.num_matched_blocks, hashes, route.peer)

    def count(self, route: Route) -> None:
        """``route`` was taken: counted by reason, and its matched prefix remembered."""
        self.decisions[route.reason.value] += 1
        if route.num_matched_blocks and route.hashes:
            key = route.hashes[route.num_matched_blocks - 1]
            self._recent[key] = (self._sharers(key) + 1.0, self._clock())
            self._recent.move_to_end(key)
            while len(self._recent) > RECENT_MAX:
                self._recent.popitem(last=False)

    def _sharers(self, key: int) -> float:
        """How many requests routed lately matched up to block ``key`` (halved every
        SHARED_HALF_LIFE_S)."""
        entry = self._recent.get(key)
        if entry is None:
            return 0.0
        count, when = entry
        return count * 0.5 ** (max(0.0, self._clock() - when) / SHARED_HALF_LIFE_S)

    def status(self, engines: Sequence[RoutedEngine]) -> dict[str, Any]:
        """Per engine: blocks in its prefix index, requests routed, their hit rate (the
        engines' own num_cached_tokens over their prompt tokens); decisions by reason."""
        return {"policy": self.policy.value, "decisions": dict(self.decisions),
                "engines": {str(e.index): {
                    "state": str(e.state), "num_cached_blocks": len(e.prefix), "num_routed": e.num_routed,
                    "routed_prompt_tokens": e.num_routed_prompt_tokens,
                    "routed_cached_tokens": e.num_routed_cached_tokens,
                    "routed_hit_rate": round(e.routed_hit_rate, 4),
                    "num_routed_while_down": e.num_routed_while_down,
                    "index_gaps": e.prefix.num_gaps} for e in engines}}


def prompt_hashes(request: EngineCoreRequest, block_size: int) -> list[int]:
    """The prompt's chained block hashes as its engine will compute them (linear in the
    prompt, with its cache_salt); none for a request asking for prompt logprobs (it takes no
    cached block) or one whose token ids cannot be hashed (its engine will refuse it)."""
    if request.sampling_params.prompt_logprobs is not None:
        return []
    try:
        return hash_request_blocks(request.prompt_token_ids, block_size, [], request.cache_salt)
    except (OverflowError, TypeError, ValueError, struct.error, UnicodeError):
        return []
