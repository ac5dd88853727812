"""What one node of an expert-parallel cluster keeps from etcd, without polling it.

``NodeView``: the placement this node's supervisor follows, the node records and the
newest epoch's ranks, each from a watch of those keys alone: a node reads nothing per
tick and receives none of the engine records' events. ``LeaderWatch``: the leader, and
only the leader, watches the whole cluster prefix, so any change there (an engine READY,
``desired``, a failure report) wakes its controller. ``campaign_spread_s``: how widely
the nodes spread their campaigns after the leader key goes. elastic/cluster.py's
``EPNode`` wires them; bench/membership_sim.py runs them at 256 nodes. No torch here.

Measured with bench/membership_scale.py (docs/elastic.md): polling placement, node list
and epoch after every tick cost 64 idle nodes 1008 range requests and 5 MB a second of
etcd (N^2 bytes); from the watches, 92 requests and 0.16 MB (keep-alives, mostly).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from planaria.elastic.election import LeaderElection
from planaria.elastic.errors import RecordDecodeError
from planaria.elastic.keys import Epoch, NodeInfo, decode, epoch_problem
from planaria.elastic.membership import Membership
from planaria.elastic.placement import Placement
from planaria.elastic.reconcile import placement_problem
from planaria.elastic.watch import KeyWatch

log = structlog.get_logger("planaria.elastic.node_view")
CAMPAIGN_SPREAD_PER_NODE_S = 0.005  # a failover's campaigns spread over this much per node


def campaign_spread_s(lease_ttl_s: float, num_nodes: int) -> float:
    """After the leader key goes, each node campaigns at a random moment within this: a
    spread that grows with the cluster, so 256 nodes do not all hit etcd at once while two
    do not wait a third of the TTL for nothing (elastic/election.py)."""
    return min(lease_ttl_s / 3, CAMPAIGN_SPREAD_PER_NODE_S * max(1, num_nodes))


class NodeView:
    """What a node's supervisor follows, kept from watches of those keys alone (no read per
    tick, and none of the engine records' events): the placement (followed once it passes
    ``controller.placement_problem`` against the node records), the node records, the
    newest epoch's ranks. A record that fails its checks is refused with an error in the
    log (once while it stays the same): the view keeps what it had. ``on_change()`` is
    called after every batch of events."""

    def __init__(self, membership: Membership, num_experts: int, on_change: Callable[[], None]) -> None:
        self.membership, self.num_experts, self.on_change = membership, num_experts, on_change
        self.placement = None
        self.epoch_ranks: list[str] = []
        self._nodes: dict[str, NodeInfo] = {}
        self._seen = None  # the newest placement seen
        self._last_refusal = ""

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def start(self) -> "NodeView":
        layout = self.membership.layout
        self.membership.watch_prefix(layout.nodes_prefix, self._on_node_events)
        self.membership.watch_prefix(layout.placement, self._on_events)
        self.membership.watch_prefix(layout.epoch, self._on_events)
        return self

    def _on_node_events(self, events) -> None:
        for ev in events:
            node_id = ev.key.rsplit("/", 1)[-1]
            if ev.value is None:
                self._nodes.pop(node_id, None)
                continue
            try:
                self._nodes[node_id] = decode(ev.key, ev.value, NodeInfo)
            except RecordDecodeError as exc:
                self._refused(f"node record refused: {exc}")
        self._follow(self._seen)
        self.on_change()

    def _on_events(self, events) -> None:
        layout = self.membership.layout
        for ev in events:
            if ev.value is None:
                continue
            try:
                if ev.key == layout.placement:
                    self._seen = decode(ev.key, ev.value, Placement)
                    self._follow(self._seen)
                elif ev.key == layout.epoch:
                    epoch = decode(ev.key, ev.value, Epoch)
                    problem = epoch_problem(epoch, num_experts=self.num_experts)
                    if problem:
                        raise RecordDecodeError(ev.key, ValueError(problem))
                    self.epoch_ranks = list(epoch.ranks)
            except RecordDecodeError as exc:
                self._refused(f"{ev.key.rsplit('/', 1)[-1]} refused: {exc}")
        self.on_change()

    def _follow(self, placement) -> None:
        if placement is None:
            return
        problem = placement_problem(placement, list(self._nodes.values()))
        if problem:
            self._refused(f"placement refused: {problem}")
            return
        self.placement = placement

    def _refused(self, why: str) -> None:
        if why != self._last_refusal:
            log.error("record refused; not acted on", reason=why)
            self._last_refusal = why


class LeaderWatch:
    """The leader watches the whole cluster prefix (any change there wakes its controller:
    an engine READY, desired, a failure report); a node that stops leading drops the watch,
    so a follower never receives every engine record's events."""

    def __init__(self, membership: Membership, election: LeaderElection, on_change: Callable[[], None]) -> None:
        self.membership, self.election, self.on_change = membership, election, on_change
        self._watch: KeyWatch | None = None

    def follow(self) -> None:
        leading = self.election.is_leader
        if leading and self._watch is None:
            self._watch = KeyWatch(self.membership.client, self.membership.layout.prefix,
                                   lambda _events: self.on_change(), name="cluster").start()
        elif not leading and self._watch is not None:
            self.stop()

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
