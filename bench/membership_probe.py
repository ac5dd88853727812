"""What bench/membership_scale.py watches: the cluster's keys as they change, and etcd's
own counters.

``Observer`` is one ``KeyWatch`` on the cluster's prefix (the bench's own etcd client):
every epoch written, engine record, node or engine deleted, leader change and op phase,
with the ``time.monotonic()`` at which the bench saw it. ``served_at[n]`` is when every
rank of epoch ``n`` had reported SERVING in it. ``wait(predicate, timeout_s)`` blocks
until a predicate over the observer holds.

``EtcdMetrics`` scrapes etcd's Prometheus endpoint (``http://<client url>/metrics``, which
etcd 3.5 serves on its client port) every ``interval_s``; ``window(t0, t1)`` turns two
samples into rates: gRPC calls started per method (``grpc_server_started_total``), stream
messages (``grpc_server_msg_received_total``: lease keep-alives, watch requests), watch
events sent to watchers (``etcd_debugging_mvcc_events_total``), revisions, etcd's own CPU,
and the gauges at the end (keys, watchers, database size and size in use).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import msgspec

from planaria.elastic.keys import EngineRecord, EngineRecordState, Epoch, KeyLayout, OpRecord, decode
from planaria.elastic.watch import DELETE, KeyWatch, WatchEvent


class Observer:
    """The cluster's keys as the bench sees them change (module docstring)."""

    def __init__(self, client: Any, layout: KeyLayout) -> None:
        self.layout = layout
        self._cond = threading.Condition()
        self.engines: dict[str, EngineRecord] = {}
        self.epochs: list[tuple[float, Epoch]] = []          # every epoch written, in order
        self.served_at: dict[int, float] = {}                # epoch number -> all ranks SERVING
        self.leader_events: list[tuple[float, str | None]] = []  # (t, node id; None: deleted)
        self.deleted_at: dict[str, float] = {}               # key -> when last deleted
        self.op_phases: dict[tuple[str, str], float] = {}    # (op id, phase) -> first seen
        self.num_events = 0
        self._watch = KeyWatch(client, layout.prefix, self._on_events, name="bench-observer")

    def start(self, timeout_s: float = 10.0) -> Observer:
        self._watch.start()
        if not self._watch.wait_watching(timeout_s):
            raise TimeoutError(f"the observer's watch was not confirmed within {timeout_s:g} s")
        return self

    def stop(self) -> None:
        self._watch.stop()

    @property
    def leader(self) -> str | None:
        with self._cond:
            return self.leader_events[-1][1] if self.leader_events else None

    @property
    def epoch(self) -> Epoch | None:
        with self._cond:
            return self.epochs[-1][1] if self.epochs else None

    def epochs_since(self, t: float) -> list[tuple[float, Epoch]]:
        with self._cond:
            return [(at, e) for at, e in self.epochs if at >= t]

    def wait(self, predicate: Callable[[], Any], timeout_s: float) -> Any:
        """``predicate()``'s first truthy value, re-checked after each batch of events;
        raises TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"not within {timeout_s:g} s")
                self._cond.wait(min(left, 0.5))

    def _on_events(self, events: list[WatchEvent]) -> None:
        t = time.monotonic()
        with self._cond:
            self.num_events += len(events)
            for ev in events:
                self._apply(t, ev)
            self._note_served(t)
            self._cond.notify_all()

    def _apply(self, t: float, ev: WatchEvent) -> None:
        key, layout = ev.key, self.layout
        if ev.kind == DELETE:
            self.deleted_at[key] = t
            if key.startswith(layout.engines_prefix):
                self.engines.pop(KeyLayout.last_segment(key), None)
            elif key == layout.leader:
                self.leader_events.append((t, None))
            return
        if key == layout.leader:
            self.leader_events.append((t, (ev.value or b"").decode("utf-8", "replace")))
        elif key == layout.epoch:
            self.epochs.append((t, decode(key, ev.value or b"", Epoch)))
        elif key.startswith(layout.engines_prefix):
            record = decode(key, ev.value or b"", EngineRecord)
            self.engines[record.engine_id] = record
        elif key.startswith(layout.ops_prefix):
            op = decode(key, ev.value or b"", OpRecord)
            self.op_phases.setdefault((op.op_id, op.phase.value), t)

    def _note_served(self, t: float) -> None:
        if not self.epochs:
            return
        epoch = self.epochs[-1][1]
        if epoch.number in self.served_at:
            return
        if all((r := self.engines.get(e)) is not None and r.epoch == epoch.number
               and r.state == EngineRecordState.SERVING for e in epoch.ranks):
            self.served_at[epoch.number] = t


# ----------------------------------------------------------------------------- etcd metrics

_COUNTERS = ("etcd_debugging_mvcc_events_total", "etcd_mvcc_put_total", "etcd_mvcc_txn_total",
             "etcd_mvcc_range_total", "etcd_mvcc_delete_total", "etcd_debugging_lease_renewed_total",
             "etcd_debugging_lease_granted_total", "etcd_debugging_server_lease_expired_total",
             "process_cpu_seconds_total", "etcd_network_client_grpc_sent_bytes_total",
             "etcd_network_client_grpc_received_bytes_total")
_GAUGES = ("etcd_debugging_mvcc_current_revision", "etcd_debugging_mvcc_keys_total",
           "etcd_debugging_mvcc_watcher_total", "etcd_debugging_mvcc_watch_stream_total",
           "etcd_mvcc_db_total_size_in_bytes", "etcd_mvcc_db_total_size_in_use_in_bytes")
_PER_METHOD = ("grpc_server_started_total", "grpc_server_msg_received_total")


class Sample(msgspec.Struct, frozen=True):
    t: float
    values: dict[str, float]


def parse_metrics(text: str) -> dict[str, float]:
    """The counters and gauges above from Prometheus text; per-method ones as
    ``name:Method`` (summed over their other labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if name in _PER_METHOD:
            method = _label(labels, "grpc_method")
            out[f"{name}:{method}"] = out.get(f"{name}:{method}", 0.0) + float(value)
        elif name in _COUNTERS or name in _GAUGES:
            out[name] = out.get(name, 0.0) + float(value)
    return out


def _label(labels: str, name: str) -> str:
    start = labels.find(f'{name}="')
    if start < 0:
        return ""
    start += len(name) + 2
    return labels[start:labels.find('"', start)]


class EtcdMetrics:
    """etcd's /metrics, sampled every ``interval_s`` on a thread of its own."""

    def __init__(self, endpoint: str, interval_s: float = 0.25) -> None:
        self._url = f"http://{endpoint}/metrics"
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-metrics", daemon=True)

    def start(self) -> EtcdMetrics:
        self._samples.append(self.scrape())
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def scrape(self, timeout_s: float = 5.0) -> Sample:
        with urllib.request.urlopen(self._url, timeout=timeout_s) as resp:  # noqa: S310 - loopback etcd
            text = resp.read().decode()
        return Sample(time.monotonic(), parse_metrics(text))

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                sample = self.scrape()
            except (urllib.error.URLError, OSError):
                continue  # etcd busy: the next sample covers the gap
            with self._lock:
                self._samples.append(sample)

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """Rates over [t0, t1] from the last sample at or before t0 and the first at or
        after t1 (a fresh scrape if there is none yet), and the gauges at its end."""
        latest = self.scrape()
        with self._lock:
            self._samples.append(latest)
            before = [s for s in self._samples if s.t <= t0] or self._samples[:1]
            after = [s for s in self._samples if s.t >= t1] or [latest]
        a, b = before[-1], after[0]
        return rates(a, b)


def rates(a: Sample, b: Sample) -> dict[str, float]:
    """Per-second rates of the counters between two samples, and the gauges at ``b``."""
    dt = max(b.t - a.t, 1e-9)
    d = {k: b.values.get(k, 0.0) - a.values.get(k, 0.0) for k in b.values}
    calls = {k.split(":", 1)[1]: v for k, v in d.items() if k.startswith("grpc_server_started_total:")}
    msgs = {k.split(":", 1)[1]: v for k, v in d.items() if k.startswith("grpc_server_msg_received_total:")}
    unary = sum(v for m, v in calls.items() if m not in ("Watch", "LeaseKeepAlive"))
    return {
        "seconds": dt,
        "rpc_per_s": (unary + msgs.get("LeaseKeepAlive", 0.0) + msgs.get("Watch", 0.0)) / dt,
        "txn_per_s": calls.get("Txn", 0.0) / dt,
        "range_per_s": calls.get("Range", 0.0) / dt,
        "put_per_s": calls.get("Put", 0.0) / dt,
        "keepalive_per_s": msgs.get("LeaseKeepAlive", 0.0) / dt,
        "watch_creates_per_s": msgs.get("Watch", 0.0) / dt,
        "watch_events_per_s": d.get("etcd_debugging_mvcc_events_total", 0.0) / dt,
        "revisions_per_s": d.get("etcd_debugging_mvcc_current_revision", 0.0) / dt,
        "revisions": d.get("etcd_debugging_mvcc_current_revision", 0.0),
        "etcd_cpu": d.get("process_cpu_seconds_total", 0.0) / dt,
        "sent_bytes_per_s": d.get("etcd_network_client_grpc_sent_bytes_total", 0.0) / dt,
        "leases_expired": d.get("etcd_debugging_server_lease_expired_total", 0.0),
        "leases_granted": d.get("etcd_debugging_lease_granted_total", 0.0),
        "keys": b.values.get("etcd_debugging_mvcc_keys_total", 0.0),
        "keys_delta": d.get("etcd_debugging_mvcc_keys_total", 0.0),
        "watchers": b.values.get("etcd_debugging_mvcc_watcher_total", 0.0),
        "db_bytes": b.values.get("etcd_mvcc_db_total_size_in_bytes", 0.0),
        "db_in_use_bytes": b.values.get("etcd_mvcc_db_total_size_in_use_in_bytes", 0.0),
        "db_in_use_delta": d.get("etcd_mvcc_db_total_size_in_use_in_bytes", 0.0),
        "revision": b.values.get("etcd_debugging_mvcc_current_revision", 0.0),
    }
