"""Which node runs how many engines: the leader's placement of ``desired`` over the nodes.

``desired`` is the cluster-wide engine count. The leader turns it into a ``Placement``
(node id -> engine count, the ``placement`` key) and every supervisor reconciles its own
engine slots to its share (daemon/ep_supervisor.py). Pure logic here, plus the store.

``place(target, nodes, previous)``, in order:

1. Start from the previous placement for the nodes still there; a node new to it brings
   its own ``--engines`` (``NodeInfo.capacity["engines"]``): existing engines are kept.
   Every share is capped at the node's capacity (``capacity["max_engines"]``).
2. Too few: add one engine at a time on the node with the fewest that has capacity left
   (ties: the oldest node, then the node id).
3. Too many: remove one at a time from the node with the most (ties: the newest node,
   then the highest node id).
4. What fits on no node is ``unplaced`` (the cluster serves with fewer engines).

When ``desired`` was never set the target is the sum of the nodes' ``--engines``.

``allowed_engines(shares, records)`` names the engines a placement keeps: on each node the
``share`` lowest-numbered engines (``engine_index``) that are not stopped or failed, the
same rule its supervisor applies when it removes engines (highest slot ids go first).

The ``placement`` key is written by the leader only, fenced like ``epoch`` (the leader key's
create revision) plus a compare on the key's own mod revision.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from planaria.elastic.errors import PlacementConflictError
from planaria.elastic.keys import EngineRecord, EngineRecordState, KeyLayout, NodeInfo, encode
from planaria.elastic.records import fenced_put, read_record


class Placement(msgspec.Struct, kw_only=True):
    engines: dict[str, int]  # node id -> engine count
    target: int              # the cluster-wide count placed (desired, or the nodes' --engines)
    unplaced: int = 0        # engines of ``target`` no node had capacity for
    leader: str = ""
    created_at: float = 0.0


def initial_engines(node: NodeInfo) -> int:
    return max(0, int(node.capacity.get("engines", 0)))


def max_engines(node: NodeInfo) -> int:
    return max(0, int(node.capacity.get("max_engines", initial_engines(node))))


def default_target(nodes: Iterable[NodeInfo]) -> int:
    """The cluster-wide count when ``desired`` was never set: the sum of the nodes' --engines."""
    return sum(min(initial_engines(n), max_engines(n)) for n in nodes)


def capacity(nodes: Iterable[NodeInfo]) -> int:
    return sum(max_engines(n) for n in nodes)


def place(target: int, nodes: list[NodeInfo], previous: dict[str, int] | None) -> tuple[dict[str, int], int]:
    """``(node id -> engine count, unplaced)`` for ``target`` engines over ``nodes``."""
    if target < 0:
        raise ValueError(f"target must be >= 0, got {target}")
    previous = previous or {}
    by_id = {n.node_id: n for n in nodes}
    shares = {nid: min(previous.get(nid, initial_engines(n)), max_engines(n)) for nid, n in by_id.items()}
    age = {nid: (n.started_at, nid) for nid, n in by_id.items()}
    while sum(shares.values()) < target:
        room = [nid for nid in shares if shares[nid] < max_engines(by_id[nid])]
        if not room:
            break
        shares[min(room, key=lambda nid: (shares[nid], age[nid]))] += 1
    while sum(shares.values()) > target:
        busy = [nid for nid in shares if shares[nid] > 0]
        nid = max(busy, key=lambda nid: (shares[nid], age[nid]))
        shares[nid] -= 1
    return dict(sorted(shares.items())), max(0, target - sum(shares.values()))


def engine_index(record: EngineRecord) -> int:
    try:
        return int(record.addresses.get("engine_index", ""))
    except ValueError:
        return 1 << 30  # unknown: after every numbered engine


GONE = (EngineRecordState.STOPPED, EngineRecordState.FAILED)


def allowed_engines(shares: dict[str, int], records: Iterable[EngineRecord]) -> set[str]:
    """The engines the placement keeps: each node's ``share`` lowest-numbered engines."""
    by_node: dict[str, list[EngineRecord]] = {}
    for r in records:
        if r.state not in GONE:
            by_node.setdefault(r.node_id, []).append(r)
    allowed: set[str] = set()
    for nid, recs in by_node.items():
        recs.sort(key=lambda r: (engine_index(r), r.engine_id))
        allowed.update(r.engine_id for r in recs[:shares.get(nid, 0)])
    return allowed


class PlacementStore:
    def __init__(self, client: Any, cluster: str) -> None:
        self._client = client
        self.layout = KeyLayout(cluster)

    def read(self) -> tuple[Placement | None, int]:
        """``(placement, mod_revision)``; ``(None, 0)`` before the first one."""
        return read_record(self._client, self.layout.placement, Placement, "placement")

    def write(self, placement: Placement, expected_mod_revision: int, leader_create_revision: int) -> None:
        """Write ``placement`` if the key is still at ``expected_mod_revision`` and the leader
        key still of ``leader_create_revision``: StaleLeaderError / PlacementConflictError if not."""
        fenced_put(self._client, self.layout.placement, encode(placement),
                   expected_mod_revision=expected_mod_revision, leader_key=self.layout.leader,
                   leader_create_revision=leader_create_revision, conflict=PlacementConflictError,
                   what="placement")
