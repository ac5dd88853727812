"""Simulated EP nodes for bench/membership_scale.py: the real membership, election, watch
and controller code against a real etcd, with no model and no process per engine.

A ``SimNode`` is what one ``planaria serve --parallel ep`` node puts into etcd and does
there, wired the way elastic/cluster.py ``EPNode`` wires it:

- its own etcd client and ``Membership`` (lease, keep-alive thread), its node record
  (capacity ``{"engines": 1, "max_engines": 1}``);
- the real ``LeaderElection`` (counted: ``CountedElection`` notes each campaign's time)
  and the real ``EPController`` (``place_engines=True``, no launcher), ticked by a loop
  like ``EPNode._run``; ``tick_s`` is the fallback, ``MIN_TICK_S`` coalesces a burst;
- after each tick, the supervisor's part: the node follows its share of the placement
  (elastic/placement.py), adding its engine when the share is 1 and removing it when the
  share is 0 and no epoch names it any more. ``view="watch"`` (the default) is EPNode's
  own code: ``NodeView`` keeps placement, node records and epoch from watches of those
  keys, ``LeaderWatch`` gives the leader alone a watch of the whole prefix, and the
  campaigns spread by ``campaign_spread_s`` (elastic/node_view.py). ``view="poll"`` is
  EPNode before that: every node watched the whole prefix and, after every tick, read
  the placement, the whole node list, the epoch and (once a second) the KV figure; the
  bench keeps it to show the difference;
- one ``SimEngine``: its record on the node's lease, LOADING and then READY
  ``engine_load_s`` later (a real engine's start: no model is loaded, the node's loop
  writes READY when the time has come), a watch on the ``epoch`` key like ep_proc's; when
  an epoch names it, it "switches" after ``switch_delay_s`` by writing its record SERVING
  with ``epoch = served_epoch``.

``SimNode.crash()`` stops everything without revoking the lease: the cluster sees the
node's keys go when the lease runs out, as after a real crash.

The worker processes that host them: bench/membership_workers.py.
Times are ``time.monotonic()``, which is one clock for every process of the host.
Threads per node: keep-alive, election loop, node loop, watches (leader key, the epoch
for the engine, and nodes/placement/epoch for the view, or the cluster prefix) and gRPC's
helpers, about 10; at 16 nodes a worker runs ~160.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import structlog

from planaria.elastic.controller import EPController, placement_problem
from planaria.elastic.election import LeaderElection
from planaria.elastic.errors import ElasticError, EtcdUnavailableError
from planaria.elastic.keys import EngineRecord, EngineRecordState, Epoch, NodeInfo, decode
from planaria.elastic.membership import Membership
from planaria.elastic.node_view import LeaderWatch, NodeView, campaign_spread_s
from planaria.elastic.placement import Placement
from planaria.elastic.watch import KeyWatch, WatchEvent

FINGERPRINT = "sim"
DEVICE_KIND = "cpu"
# elastic/cluster.py's MIN_TICK_S, copied: importing cluster.py imports torch (2.5 s and
# ~300 MB per worker) for the rendezvous store, which no simulated node has.
MIN_TICK_S = 0.005
log = structlog.get_logger("bench.membership_sim")
START_WAIT_S = 20.0  # a node's first write waits this long for etcd (EPNode.start's START_ETCD_WAIT_S)


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What every simulated node of a run shares."""

    endpoint: str
    cluster: str
    ttl_s: int = 3                 # the node lease (EPNode's default lease_ttl_s)
    tick_s: float = 0.2            # EPNode's default
    num_experts: int = 256
    switch_delay_s: float = 0.05   # an engine's simulated group switch
    engine_load_s: float = 3.0     # an engine's simulated start (spawn -> READY)
    switch_timeout_s: float = 30.0
    view: Literal["poll", "watch"] = "watch"  # "watch": EPNode's NodeView; "poll": EPNode before it


class CountedElection(LeaderElection):
    """The real election; each campaign transaction's time goes to ``log`` as (t, node)."""

    def __init__(self, membership: Membership, log: list[tuple[float, str]], **kw: Any) -> None:
        super().__init__(membership, **kw)
        self._log = log
        self._node = membership.node_id

    def campaign(self) -> bool:
        self._log.append((time.monotonic(), self._node))
        return super().campaign()


class SimEngine:
    """An engine without a model: LOADING, READY ``load_s`` later (``poll_ready``), then
    SERVING in each epoch that names it."""

    def __init__(self, membership: Membership, engine_id: str, index: int, config: SimConfig) -> None:
        self._membership = membership
        self.engine_id = engine_id
        self._index = index
        self._switch_delay_s = config.switch_delay_s
        self._ready_at = time.monotonic() + config.engine_load_s
        self._ready = False
        self._served_epoch = 0
        self._stopped = threading.Event()
        self._watch: KeyWatch | None = None

    def start(self) -> SimEngine:
        self._write(EngineRecordState.LOADING, rank=None, epoch=0)
        self._watch = self._membership.watch_prefix(self._membership.layout.epoch, self._on_epoch_events)
        return self

    def poll_ready(self, now: float) -> None:
        """Write READY once the simulated load time is over (the node's loop calls this)."""
        if not self._ready and now >= self._ready_at:
            self._write(EngineRecordState.READY, rank=None, epoch=0)
            self._ready = True

    def stop(self) -> None:
        """Stop watching (the record is the node's to remove, or its lease's to take)."""
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()

    def _write(self, state: EngineRecordState, rank: int | None, epoch: int) -> None:
        self._membership.put_engine(EngineRecord(
            engine_id=self.engine_id, node_id=self._membership.node_id, rank=rank, epoch=epoch, state=state,
            addresses={"engine_index": str(self._index)}, served_epoch=self._served_epoch))

    def _on_epoch_events(self, events: list[WatchEvent]) -> None:
        last = events[-1]
        if last.value is None or last.key != self._membership.layout.epoch:
            return
        epoch = decode(last.key, last.value, Epoch)
        if epoch.number <= self._served_epoch or self.engine_id not in epoch.ranks:
            return  # not ours: a departing rank waits for its node to remove it
        if self._stopped.wait(self._switch_delay_s):
            return
        self._served_epoch = epoch.number
        try:
            self._write(EngineRecordState.SERVING, rank=epoch.ranks.index(self.engine_id), epoch=epoch.number)
        except EtcdUnavailableError:
            self._served_epoch = 0  # not reported: the next epoch event tries again


class SimNode:
    """One simulated node (module docstring); ``start``, then ``crash`` or ``stop``."""

    def __init__(self, config: SimConfig, node_id: str, index: int, campaigns: list[tuple[float, str]]) -> None:
        self.config = config
        self.node_id = node_id
        self._index = index
        self.membership = Membership.from_endpoints(config.endpoint, config.cluster, node_id, ttl_s=config.ttl_s)
        self._wake = threading.Event()
        watch = config.view == "watch"
        self.view = NodeView(self.membership, config.num_experts, on_change=self._wake.set) if watch else None
        spread = {"campaign_spread_s": lambda: campaign_spread_s(config.ttl_s, self.view.num_nodes)} if watch else {}
        self.election = CountedElection(self.membership, campaigns, **spread)
        self.leader_watch = LeaderWatch(self.membership, self.election, on_change=self._wake.set) if watch else None
        self.rendezvous = f"127.0.0.1:{20000 + index}"  # never dialled: no group forms here
        self.controller = EPController(
            self.membership, self.election, config.cluster, num_experts=config.num_experts,
            rendezvous=self.rendezvous, launch=None, model_fingerprint=FINGERPRINT, device_kind=DEVICE_KIND,
            block_size=16, initial_engines=1, engine_prefix=f"{node_id}-e",
            switch_timeout_s=config.switch_timeout_s, place_engines=True)
        self.engine: SimEngine | None = None
        self._kv_read_at = 0.0
        self._placement: Placement | None = None   # the view the node follows
        self._epoch_ranks: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sim:{node_id}", daemon=True)

    def start(self) -> float:
        """Lease, node record, engine, election, loop; returns when it began (monotonic)."""
        started_at = time.monotonic()
        self.membership.start()
        info = NodeInfo(node_id=self.node_id, host="127.0.0.1", addresses={"rendezvous": self.rendezvous},
                        capacity={"engines": 1, "max_engines": 1}, started_at=time.time())
        _retry(lambda: self.membership.register_node(info), START_WAIT_S)
        self.engine = SimEngine(self.membership, f"{self.node_id}-e0", 0, self.config)
        _retry(self.engine.start, START_WAIT_S)
        self.election.start()
        self._thread.start()
        return started_at

    def crash(self) -> dict[str, float]:
        """Stop every thread and stream without revoking: the lease runs out by itself."""
        t_crash = time.monotonic()
        valid_until = self.membership.lease_valid_until
        self._halt(revoke=False)
        return {"t_crash": t_crash, "lease_valid_until": valid_until}

    def stop(self) -> None:
        self._halt(revoke=True)

    def _halt(self, revoke: bool) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:  # started
            self._thread.join(5.0)
        if self.engine is not None:
            self.engine.stop()
        self.election.stop(resign=revoke)
        self.membership.close(revoke=revoke)

    def _run(self) -> None:
        """EPNode._run: act at once on a change, else every tick_s."""
        if self.view is not None:
            self.view.start()
        else:
            self.membership.watch_prefix(self.membership.layout.prefix, self._on_events)
        while not self._stop.is_set():
            self._wake.wait(self.config.tick_s)
            self._wake.clear()
            if self._stop.wait(MIN_TICK_S):
                break
            try:
                if self.leader_watch is not None:
                    self.leader_watch.follow()
                self.controller.tick()
                if self.view is None:
                    self._poll_view()
                else:
                    self._placement, self._epoch_ranks = self.view.placement, self.view.epoch_ranks
                self._follow_placement()
            except ElasticError:  # etcd busy or away: the next tick tries again
                continue
            except Exception:  # noqa: BLE001 - like EPNode._run, the loop outlives a bad tick
                log.exception("sim tick crashed", node_id=self.node_id)
        if self.leader_watch is not None:
            self.leader_watch.stop()

    def _on_events(self, events: list[WatchEvent]) -> None:
        """``view="poll"``: the old EPNode's prefix watch only woke the loop."""
        self._wake.set()

    def _poll_view(self) -> None:
        """EPNode._refresh_view's reads: placement (checked against every node record),
        epoch, and the group's KV figure at most once a second."""
        c = self.controller
        placement, _rev = c.placements.read()
        if placement is None or not placement_problem(placement, c.membership.list_nodes()):
            self._placement = placement
        epoch, _rev = c.epochs.read_epoch()
        self._epoch_ranks = epoch.ranks if epoch is not None else []
        now = time.monotonic()
        if now - self._kv_read_at >= 1.0:
            self._kv_read_at = now
            c.kv.smallest_for_group(c.fp, c.device_kind, self._epoch_ranks)

    def _follow_placement(self) -> None:
        """The supervisor's part: its engine follows this node's share of the placement
        (its --engines, 1, until the leader has placed it)."""
        placement, ranks = self._placement, self._epoch_ranks
        share = placement.engines.get(self.node_id, 1) if placement is not None else 1
        if self.engine is not None:
            self.engine.poll_ready(time.monotonic())
        if share >= 1 and self.engine is None:
            self.engine = SimEngine(self.membership, f"{self.node_id}-e0", 0, self.config).start()
        elif share == 0 and self.engine is not None and self.engine.engine_id not in ranks:
            engine, self.engine = self.engine, None
            engine.stop()
            self.membership.remove_engine(engine.engine_id)


def _retry(action: Callable[[], Any], wait_s: float) -> None:
    """``action()``, again every 0.5 s while etcd does not answer, for ``wait_s`` at most."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            action()
            return
        except EtcdUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
