"""A node's membership in the cluster: its lease, and the keys it owns on that lease.

``Membership`` is the supervisor's one handle on etcd. It

- grants a lease (``ttl_s``) and keeps it alive from a thread of its own;
- remembers every key it owns (``nodes/<node>``, ``engines/<engine>``) with its value, so
  a lost lease (etcd down longer than the TTL, or the lease expired or was revoked) is
  re-granted and every owned key re-written as soon as etcd answers again;
- never blocks the serving path on etcd: each RPC has a short timeout (about 1.5 s) and
  a failed write raises :class:`EtcdUnavailableError` at once. The intent is kept: a key
  put (or removed) while etcd is down is written (or deleted) when it comes back.

Lease listeners (``add_lease_listener``) hear ``(old_lease_id, new_lease_id)`` whenever
the lease changes or is lost (``new_lease_id`` None); leader election uses this to drop
leadership the moment the lease it was won on is gone.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import structlog

from planaria.elastic.errors import EtcdUnavailableError, RecordDecodeError
from planaria.elastic.etcd_client import (DEFAULT_RPC_TIMEOUT_S, ClientFactory, client_factory,
                                 etcd_call, is_lease_not_found)
from planaria.elastic.etcd_security import EtcdSecurity
from planaria.elastic.keys import EngineRecord, KeyLayout, NodeInfo, decode, encode
from planaria.elastic.watch import KeyWatch, WatchCallback

log = structlog.get_logger(__name__)

LeaseListener = Callable[[int | None, int | None], None]


class Membership:
    """Holds ``node_id``'s lease in ``cluster`` and the keys written on it.

    ``client_factory`` builds the etcd3 client (see :mod:`elastic.etcd_client`); use
    :meth:`from_endpoints` for the real one. Call :meth:`start` to run the keepalive
    thread; the constructor does not talk to etcd.
    """

    def __init__(self, client_factory: ClientFactory, cluster: str, node_id: str,
                 ttl_s: int = 10, *, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s < 2:
            raise ValueError(f"ttl_s must be >= 2 (etcd's minimum is practical), got {ttl_s}")
        self.layout = KeyLayout(cluster)
        self.node_id = node_id
        self.ttl_s = int(ttl_s)
        self.client = client_factory()
        self._clock = clock
        # Two locks: ``_lock`` guards fields and is never held across an RPC, so state
        # reads never wait on etcd; ``_io_lock`` serialises writes of owned keys with
        # lease grants and re-writes (so a re-write cannot put back a value that a
        # concurrent put_owned just replaced). Callers wait on it for one RPC timeout
        # at most, then get EtcdUnavailableError.
        self._lock = threading.Lock()
        self._io_lock = threading.RLock()
        self._io_wait_s = float(getattr(self.client, "timeout", None) or DEFAULT_RPC_TIMEOUT_S)
        self._lease_id: int | None = None
        self._lease_valid_until = 0.0         # monotonic; conservative
        self._connected = False
        self._owned: dict[str, bytes] = {}
        self._pending_deletes: set[str] = set()
        self._needs_rewrite = False           # owned keys not yet on the current lease
        self._listeners: list[LeaseListener] = []
        self._watches: list[KeyWatch] = []
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_endpoints(cls, endpoints: list[str] | str, cluster: str, node_id: str,
                       ttl_s: int = 10, rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
                       security: EtcdSecurity | None = None) -> Membership:
        return cls(client_factory(endpoints, rpc_timeout_s, security), cluster, node_id, ttl_s)

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> Membership:
        """Start the keepalive thread (it grants the lease when etcd answers)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._keepalive_loop,
                                            name=f"lease:{self.node_id}", daemon=True)
            self._thread.start()
        return self

    def close(self, revoke: bool = True) -> None:
        """Stop threads and watches; revoke the lease (deleting owned keys) if ``revoke``.

        ``close(revoke=False)`` is what a crash looks like to the cluster: the keys stay
        until the lease runs out.
        """
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.ttl_s)
        for watch in self._watches:
            watch.stop()
        self._watches.clear()
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
        if revoke and lease_id is not None:
            try:
                with etcd_call("revoke lease"):
                    self.client.revoke_lease(lease_id)
            except (EtcdUnavailableError, grpc.RpcError) as exc:
                log.warning("lease_revoke_failed", node_id=self.node_id, error=str(exc))
        self.client.close()

    def __enter__(self) -> Membership:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- state

    @property
    def is_connected(self) -> bool:
        """True when the last etcd round trip of the keepalive or a write succeeded."""
        return self._connected

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    @property
    def has_valid_lease(self) -> bool:
        """A lease is held and, as far as we know, has not run out."""
        with self._lock:
            return self._lease_id is not None and self._clock() < self._lease_valid_until

    @property
    def lease_valid_until(self) -> float:
        """When the lease runs out unless refreshed again, on ``clock``; 0.0 when none is
        held. Conservative (counted from before the last refresh was sent), so etcd
        expires it at this moment or a round trip later: bench/membership_scale.py times
        a crashed node's re-form from here."""
        with self._lock:
            return self._lease_valid_until if self._lease_id is not None else 0.0

    def add_lease_listener(self, listener: LeaseListener) -> None:
        self._listeners.append(listener)

    def ensure_lease(self) -> int:
        """The current lease id, granting one (and re-writing owned keys) if none."""
        lease_id = self._lease_id
        if lease_id is not None:
            return lease_id
        with self._io("grant lease"):
            if self._lease_id is not None:
                return self._lease_id
            sent_at = self._clock()
            try:
                with etcd_call("grant lease"):
                    lease = self.client.lease(self.ttl_s)
            except EtcdUnavailableError:
                self._connected = False
                raise
            with self._lock:
                old, self._lease_id = self._lease_id, lease.id
                self._lease_valid_until = sent_at + lease.ttl
                self._needs_rewrite = True
            self._connected = True
            log.info("lease_granted", node_id=self.node_id, lease_id=lease.id, ttl_s=lease.ttl)
            try:
                self._rewrite_owned(force=True)
            except (EtcdUnavailableError, grpc.RpcError) as exc:  # keepalive finishes it
                self._connected = False
                log.warning("owned_keys_rewrite_failed", node_id=self.node_id, error=str(exc))
        self._notify(old, lease.id)
        return lease.id

    @contextlib.contextmanager
    def _io(self, operation: str) -> Iterator[None]:
        if not self._io_lock.acquire(timeout=self._io_wait_s):
            raise EtcdUnavailableError(f"{operation}: etcd busy (re-connecting)")
        try:
            yield
        finally:
            self._io_lock.release()

    # ----------------------------------------------------------------- owned keys

    def register_node(self, info: NodeInfo) -> None:
        if info.node_id != self.node_id:
            raise ValueError(f"NodeInfo is for {info.node_id!r}, this is {self.node_id!r}")
        self.put_owned(self.layout.node(info.node_id), encode(info))

    def put_engine(self, record: EngineRecord) -> None:
        self.put_owned(self.layout.engine(record.engine_id), encode(record))

    def remove_engine(self, engine_id: str) -> None:
        self.delete_owned(self.layout.engine(engine_id))

    def put_owned(self, key: str, value: bytes) -> None:
        """Write ``key`` on the lease and keep it there; raises EtcdUnavailableError."""
        with self._lock:
            self._owned[key] = value
            self._pending_deletes.discard(key)
        with self._io(f"put {key}"):
            self._put(key, value)

    def delete_owned(self, key: str) -> None:
        with self._lock:
            self._owned.pop(key, None)
            self._pending_deletes.add(key)
        try:
            with self._io(f"delete {key}"), etcd_call(f"delete {key}"):
                self.client.delete(key)
        except EtcdUnavailableError:
            self._connected = False
            raise
        with self._lock:
            if key not in self._owned:
                self._pending_deletes.discard(key)

    def _put(self, key: str, value: bytes) -> None:
        for _attempt in range(2):
            lease_id = self.ensure_lease()
            try:
                with etcd_call(f"put {key}"):
                    self.client.put(key, value, lease=lease_id)
                self._connected = True
                return
            except EtcdUnavailableError:
                self._connected = False
                raise
            except grpc.RpcError as exc:
                if not is_lease_not_found(exc):
                    raise EtcdUnavailableError(f"put {key}", exc) from exc
                self._lease_lost(lease_id, "lease not found on put")
        raise EtcdUnavailableError(f"put {key}: lease lost twice in a row")

    # ----------------------------------------------------------------- reads, watches

    def read(self, key: str) -> bytes | None:
        """One key's value now (None: absent); raises EtcdUnavailableError."""
        with etcd_call(f"get {key}"):
            value, _meta = self.client.get(key)
        return value

    def list_nodes(self) -> list[NodeInfo]:
        return self._list(self.layout.nodes_prefix, NodeInfo)

    def list_engines(self) -> list[EngineRecord]:
        return self._list(self.layout.engines_prefix, EngineRecord)

    def _list(self, prefix: str, cls: type) -> list[Any]:
        with etcd_call(f"list {prefix}"):
            items = list(self.client.get_prefix(prefix))
        out = []
        for value, meta in items:
            try:
                out.append(decode(meta.key, value, cls))
            except Exception as exc:  # noqa: BLE001 - one bad record must not hide the rest
                log.error("record_refused", key=meta.key.decode("utf-8", "replace"), error=str(exc))
        return out

    def watch_engines(self, callback: Callable[[str, EngineRecord | None], None]) -> KeyWatch:
        """Call ``callback(engine_id, record_or_None)`` for every change under engines/.

        Starts with the current contents, and is re-established after etcd restarts
        (missed changes are replayed as a diff). Stopped by :meth:`close`.
        """
        def on_events(events: list[Any]) -> None:
            for ev in events:
                engine_id = KeyLayout.last_segment(ev.key)
                try:
                    record = decode(ev.key, ev.value, EngineRecord) if ev.value is not None else None
                except RecordDecodeError as exc:  # refused; the rest of the batch still counts
                    log.error("record_refused", key=ev.key, error=str(exc))
                    continue
                callback(engine_id, record)
        return self.watch_prefix(self.layout.engines_prefix, on_events)

    def watch_prefix(self, prefix: str, callback: WatchCallback) -> KeyWatch:
        watch = KeyWatch(self.client, prefix, callback, name=prefix).start()
        self._watches.append(watch)
        return watch

    # ----------------------------------------------------------------- keepalive

    def _keepalive_loop(self) -> None:
        backoff_s = 0.1
        while not self._stopped.is_set():
            ok = self._keepalive_once()
            if ok:
                backoff_s = 0.1
                interval_s = self.ttl_s / 3
            else:
                interval_s = backoff_s
                backoff_s = min(backoff_s * 2, 1.0, self.ttl_s / 3)
            self._wake.wait(interval_s)
            self._wake.clear()

    def _keepalive_once(self) -> bool:
        """One refresh (or grant). Returns False when etcd did not answer."""
        try:
            with self._lock:
                lease_id = self._lease_id
            if lease_id is None:
                self.ensure_lease()
                return True
            sent_at = self._clock()
            with etcd_call("refresh lease"):
                responses = list(self.client.refresh_lease(lease_id))
            ttl = responses[0].TTL if responses else 0
            if ttl <= 0:
                self._lease_lost(lease_id, "lease expired")
                self.ensure_lease()
                return True
            was_connected = self._connected
            with self._lock:
                if self._lease_id == lease_id:
                    self._lease_valid_until = sent_at + ttl
            self._connected = True
            if not was_connected or self._pending_deletes or self._needs_rewrite:
                log.info("etcd_reconnected", node_id=self.node_id, lease_id=lease_id)
                with self._io("rewrite owned keys"):
                    self._rewrite_owned(force=self._needs_rewrite)
            return True
        except (EtcdUnavailableError, grpc.RpcError) as exc:
            if self._connected:
                log.warning("etcd_unreachable", node_id=self.node_id, error=str(exc))
            self._connected = False
            return False

    def lease_lost(self, lease_id: int, reason: str) -> None:
        """A user of the lease (a transaction on it) found it gone: drop it, re-grant later."""
        self._lease_lost(lease_id, reason)
        self._wake.set()

    def _lease_lost(self, lease_id: int, reason: str) -> None:
        with self._lock:
            if self._lease_id != lease_id:
                return
            self._lease_id = None
            self._lease_valid_until = 0.0
        log.warning("lease_lost", node_id=self.node_id, lease_id=lease_id, reason=reason)
        self._notify(lease_id, None)

    def _rewrite_owned(self, force: bool) -> None:
        """Re-write owned keys on the current lease; caller holds ``_io_lock``.

        ``force``: put unconditionally (a new lease). Otherwise put only keys whose value
        differs or is missing, in one compare-per-key transaction each. Values are read
        under ``_lock`` key by key; ``_io_lock`` keeps concurrent writers out meanwhile.
        """
        with self._lock:
            lease_id = self._lease_id
            deletes = sorted(self._pending_deletes)
            keys = sorted(self._owned)
        tx = self.client.transactions
        for key in deletes:
            with etcd_call(f"delete {key}"):
                self.client.delete(key)
            with self._lock:
                if key not in self._owned:
                    self._pending_deletes.discard(key)
        for key in keys:
            with self._lock:
                value = self._owned.get(key)
            if value is None:
                continue
            with etcd_call(f"rewrite {key}"):
                if force:
                    self.client.put(key, value, lease=lease_id)
                else:
                    self.client.transaction(
                        compare=[tx.value(key) == value],
                        success=[], failure=[tx.put(key, value, lease=lease_id)])
        with self._lock:
            if self._lease_id == lease_id:
                self._needs_rewrite = False
        if keys:
            log.info("owned_keys_rewritten", node_id=self.node_id, num_keys=len(keys),
                     lease_id=lease_id)

    def _notify(self, old: int | None, new: int | None) -> None:
        for listener in list(self._listeners):
            try:
                listener(old, new)
            except Exception:  # noqa: BLE001 - a listener bug must not stop the keepalive
                log.exception("lease_listener_failed", node_id=self.node_id)


def forget_engine(client: Any, layout: KeyLayout, engine_id: str, pid: int | None) -> bool:
    """Delete ``engines/<engine_id>`` if it is still the record of process ``pid`` (a dead
    engine's, deleted at once so the leader need not wait for its lease). A record written
    meanwhile by the engine's next incarnation is kept: compare-and-delete on the key's mod
    revision. Returns whether it deleted; raises EtcdUnavailableError when etcd is down."""
    key = layout.engine(engine_id)
    with etcd_call(f"read {key}"):
        value, meta = client.get(key)
    if value is None:
        return False
    try:
        record = decode(key, value, EngineRecord)
    except Exception:  # noqa: BLE001 - an undecodable record is nobody's: delete it
        record = None
    if record is not None and pid is not None and record.addresses.get("pid") not in (None, str(pid)):
        return False  # a newer incarnation's record
    tx = client.transactions
    with etcd_call(f"delete {key}"):
        ok, _ = client.transaction(compare=[tx.mod(key) == meta.mod_revision], success=[tx.delete(key)],
                                   failure=[])
    return bool(ok)
