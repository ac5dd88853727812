"""Leader election on the ``leader`` key, with the key's create revision as fencing token.

Campaigning is one transaction: *if ``leader`` does not exist, put it (our node id, on
our lease) and read it back*. The winner's token is the key's ``create_revision``; it is
unique per term and only grows, so every write the leader makes that must not survive a
lost term (the epoch, op records) compares ``create_revision(leader) == token`` in the
same transaction (see :mod:`elastic.epochs`).

Leadership ends when the leader key goes (lease expired or revoked, resign) or the lease
it was won on is lost. :meth:`LeaderElection.start` runs a watch on the key and a loop
that campaigns whenever the watch says nobody holds the key (or holds it with our id, a
win whose answer was lost), and every ``retry_interval_s`` while the watch is not
established (etcd away: the watch cannot say). A node never campaigns while it sees
another leader, so an idle cluster sends no campaign transactions at all. When the key
goes, every node's watch says so at the same moment: each campaigns at a random moment
within ``campaign_spread_s`` (default ``retry_interval_s``), and one that sees the
winner's key before its moment comes does not campaign. So a failover costs etcd about
``1 + nodes * (watch delay / spread)`` transactions instead of one per node at once
(bench/membership_scale.py measures it), and the first campaign still goes out about
``spread / nodes`` after the key went.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import structlog

import grpc

from planaria.elastic.errors import EtcdUnavailableError
from planaria.elastic.etcd_client import etcd_call, is_lease_not_found
from planaria.elastic.membership import Membership
from planaria.elastic.watch import DELETE, KeyWatch, WatchEvent

log = structlog.get_logger(__name__)


class LeaderElection:
    """Campaign for leadership of ``membership``'s cluster on ``membership``'s lease.

    ``on_change(is_leader)`` is called (from a background thread) when this node gains
    or loses leadership.
    """

    def __init__(self, membership: Membership, *,
                 on_change: Callable[[bool], None] | None = None,
                 retry_interval_s: float | None = None,
                 campaign_spread_s: float | Callable[[], float] | None = None) -> None:
        self._membership = membership
        self._client = membership.client
        self._key = membership.layout.leader
        self._node_id = membership.node_id
        self._on_change = on_change
        self._retry_interval_s = retry_interval_s or max(membership.ttl_s / 3, 0.2)
        # a number, or a function read at each failover (EPNode: it grows with the cluster)
        self._campaign_spread_s = self._retry_interval_s if campaign_spread_s is None else campaign_spread_s
        self._lock = threading.Lock()
        self._token: int | None = None        # create revision of our leader key
        self._token_lease: int | None = None  # the lease it was won on
        self._reported = False
        self._holder: str | None = None      # the leader key's node id, as last seen (None: no key)
        self._holder_revision = 0            # ... at this revision (watch event or campaign answer)
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._vacated = threading.Event()     # the watch saw the key go: campaign, spread out
        self._thread: threading.Thread | None = None
        self._watch: KeyWatch | None = None
        membership.add_lease_listener(self._on_lease_change)

    # ----------------------------------------------------------------- state

    @property
    def is_leader(self) -> bool:
        """We won the key, it has not been seen to go, and our lease is still valid."""
        with self._lock:
            token, lease = self._token, self._token_lease
        return (token is not None and lease == self._membership.lease_id
                and self._membership.has_valid_lease)

    @property
    def leader_revision(self) -> int | None:
        """The fencing token: the leader key's create revision while we lead, else None."""
        return self._token if self.is_leader else None

    def current_leader(self) -> tuple[str | None, int]:
        """``(node_id, create_revision)`` of the leader key as etcd has it now."""
        with etcd_call("read leader"):
            value, meta = self._client.get(self._key)
        if value is None:
            return None, 0
        return value.decode("utf-8", "replace"), meta.create_revision

    # ----------------------------------------------------------------- campaign

    def campaign(self) -> bool:
        """Try once, without blocking, to become leader. True if we are leader after.

        Raises :class:`EtcdUnavailableError` when etcd does not answer.
        """
        lease_id = self._membership.ensure_lease()
        tx = self._client.transactions
        try:
            with etcd_call("campaign"):
                won, responses = self._client.transaction(
                    compare=[tx.create(self._key) == 0],
                    success=[tx.put(self._key, self._node_id, lease=lease_id), tx.get(self._key)],
                    failure=[tx.get(self._key)])
        except grpc.RpcError as exc:
            if not is_lease_not_found(exc):
                raise EtcdUnavailableError("campaign", exc) from exc
            # Our lease ran out while we were not looking (paused, or etcd was away): it is
            # re-granted on the next try; meanwhile we are not leader.
            self._membership.lease_lost(lease_id, "lease not found on campaign")
            raise EtcdUnavailableError("campaign", exc, detail="the lease had expired; re-granting") from exc
        kvs = responses[-1] if responses else []
        token = None
        holder: tuple[str, int] | None = None
        if kvs:
            value, meta = kvs[0]
            holder = (value.decode("utf-8", "replace"), meta.mod_revision)
            if won or (meta.lease_id == lease_id and holder[0] == self._node_id):
                token = meta.create_revision
        with self._lock:
            self._token = token
            self._token_lease = lease_id if token is not None else None
            if holder is not None:
                self._note_holder(*holder)
        if won:
            log.info("leader_elected", node_id=self._node_id, leader_revision=token)
        self._report()
        return token is not None

    def resign(self) -> None:
        """Give up leadership: delete the key if (and only if) it is still our term."""
        with self._lock:
            token, self._token, self._token_lease = self._token, None, None
        if token is not None:
            tx = self._client.transactions
            try:
                with etcd_call("resign"):
                    self._client.transaction(compare=[tx.create(self._key) == token],
                                             success=[tx.delete(self._key)], failure=[])
            except EtcdUnavailableError as exc:
                log.warning("resign_failed", node_id=self._node_id, error=str(exc))
        self._report()

    # ----------------------------------------------------------------- background

    def start(self) -> LeaderElection:
        """Watch the leader key and keep campaigning whenever nobody leads."""
        if self._thread is None:
            self._watch = KeyWatch(self._client, self._key, self._on_leader_events,
                                   prefix=False, name="leader").start()
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"election:{self._node_id}")
            self._thread.start()
        return self

    def stop(self, resign: bool = True) -> None:
        self._stopped.set()
        self._wake.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(5.0)
        if resign:
            self.resign()

    def _loop(self) -> None:
        while not self._stopped.is_set():
            if self._should_campaign():
                try:
                    self.campaign()
                except EtcdUnavailableError as exc:
                    log.debug("campaign_failed", node_id=self._node_id, error=str(exc))
                except Exception:  # noqa: BLE001 - the campaign loop must outlive any one failure
                    log.exception("campaign_crashed", node_id=self._node_id)
            self._report()
            self._wake.wait(self._retry_interval_s)
            self._wake.clear()
            if self._vacated.is_set():  # the key went: campaign at a random moment of the spread
                self._vacated.clear()
                spread = self._campaign_spread_s
                self._stopped.wait(random.uniform(0.0, max(0.0, spread() if callable(spread) else spread)))

    def _should_campaign(self) -> bool:
        """Not leader, and the key is free or ours as far as the watch knows; or the watch
        is not established, so it cannot know (then every ``retry_interval_s``)."""
        if self.is_leader:
            return False
        if self._watch is None or not self._watch.is_watching:
            return True
        with self._lock:
            holder = self._holder
        return holder is None or holder == self._node_id

    def _on_leader_events(self, events: list[WatchEvent]) -> None:
        last = events[-1]
        with self._lock:
            self._note_holder(None if last.kind == DELETE else (last.value or b"").decode("utf-8", "replace"),
                              last.mod_revision, watched=True)
            lost = self._token is not None and (
                last.kind == DELETE or last.create_revision != self._token)
            if lost:
                self._token = self._token_lease = None
        if lost:
            log.warning("leadership_lost", node_id=self._node_id, reason="leader key changed")
        if last.kind == DELETE:
            self._vacated.set()
        if last.kind == DELETE or lost:
            self._wake.set()
        self._report()

    def _note_holder(self, holder: str | None, revision: int, *, watched: bool = False) -> None:
        """The leader key's holder (None: no key) as of ``revision``. The watch's events
        always count (they come in order, and a fresh etcd starts its revisions again); a
        campaign's answer only when it is not older than what the watch said last (a read
        from before a deletion the watch already reported). Caller holds ``_lock``."""
        if watched or revision >= self._holder_revision:
            self._holder, self._holder_revision = holder, revision

    def _on_lease_change(self, old: int | None, new: int | None) -> None:
        with self._lock:
            lost = self._token is not None and self._token_lease != new
            if lost:
                self._token = self._token_lease = None
        if lost:
            log.warning("leadership_lost", node_id=self._node_id, reason="lease changed")
        self._wake.set()
        self._report()

    def _report(self) -> None:
        now = self.is_leader
        with self._lock:
            changed, self._reported = now != self._reported, now
        if changed and self._on_change is not None:
            try:
                self._on_change(now)
            except Exception:  # noqa: BLE001 - a callback bug must not stop the election
                log.exception("leader_callback_failed", node_id=self._node_id)
