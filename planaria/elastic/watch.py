"""A key or prefix watch that survives etcd restarts.

python3-etcd3's own watcher is not used: when its gRPC stream breaks (etcd killed) its
thread dies in a ``NameError`` (``six`` is used but not imported) and never tells the
callback. This one owns its stream and its thread:

    loop:  range-read the prefix at revision R  -> diff against the local cache,
                                                  emit synthetic events for the gaps
           stream events from R + 1             -> emit; on any break, back off, loop

So after an outage, a compaction or a missed event the callback still converges to the
true contents: every key ends with its latest PUT, or a DELETE if it went away. A prefix
is re-read ``page_keys`` keys at a time (fewer where a page of big values is refused),
every page at the first page's revision: one read of a whole large prefix (a cluster's,
with every ops/ record it ever wrote) exceeds gRPC's 4 MiB message limit, and the watch
could then never start.

Values are handed on as bytes, undecoded: their readers decode and check them
(elastic/keys.py ``decode``). A key that is not UTF-8 arrives with its bad bytes escaped
(``surrogateescape``), and nothing in a stream (a bad key, a callback's error) can end the
watch thread: only :meth:`KeyWatch.stop` does.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import msgspec
import structlog
from etcd3 import etcdrpc, utils

from planaria.elastic.errors import EtcdUnavailableError
from planaria.elastic.etcd_client import _TRANSPORT_ERRORS

log = structlog.get_logger(__name__)

PUT = "put"
DELETE = "delete"


class WatchEvent(msgspec.Struct, frozen=True):
    kind: str                 # PUT | DELETE
    key: str
    value: bytes | None       # None for DELETE
    mod_revision: int
    create_revision: int = 0  # 0 for DELETE
    resync: bool = False      # synthesized from a re-read after (re)connecting


WatchCallback = Callable[[list[WatchEvent]], None]


class _StreamBroken(Exception):
    """The server cancelled the watch or reported compaction; re-read and re-watch."""


class KeyWatch:
    """Watch ``key`` (exactly, or as a prefix) and call ``callback(events)`` on a thread.

    ``callback`` runs on the watch thread; an exception in it is logged, not raised.
    ``wait_watching(timeout_s)`` blocks until the server has confirmed the watch.
    """

    def __init__(self, client: Any, key: str, callback: WatchCallback, *,
                 prefix: bool = True, name: str = "", max_backoff_s: float = 1.0,
                 page_keys: int = 256) -> None:
        self._client = client
        self._page_keys = max(1, page_keys)
        self._key = utils.to_bytes(key)
        self._range_end = utils.prefix_range_end(self._key) if prefix else None
        self._callback = callback
        self._name = name or key
        self._max_backoff_s = max_backoff_s
        self._cache: dict[str, tuple[bytes, int]] = {}   # key -> (value, mod_revision)
        self._stopped = threading.Event()
        self._watching = threading.Event()
        self._lock = threading.Lock()
        self._responses: Any = None
        self._requests: queue.Queue[Any] | None = None
        self._thread = threading.Thread(target=self._run, name=f"watch:{self._name}",
                                        daemon=True)

    def start(self) -> KeyWatch:
        self._thread.start()
        return self

    @property
    def is_watching(self) -> bool:
        return self._watching.is_set()

    def wait_watching(self, timeout_s: float) -> bool:
        return self._watching.wait(timeout_s)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stopped.set()
        self._close_stream()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _close_stream(self) -> None:
        with self._lock:
            responses, requests = self._responses, self._requests
        if requests is not None:
            requests.put(None)
        if responses is not None:
            responses.cancel()

    def _run(self) -> None:
        backoff_s = 0.05
        while not self._stopped.is_set():
            try:
                revision = self._resync()
                backoff_s = 0.05
                self._stream(revision + 1)
            except (_StreamBroken, EtcdUnavailableError, *_TRANSPORT_ERRORS) as exc:
                if self._stopped.is_set():
                    break
                log.debug("watch_broken", watch=self._name, error=str(exc))
            except Exception:  # noqa: BLE001 - whatever etcd sends, the watch goes on
                if self._stopped.is_set():
                    break
                log.exception("watch_failed", watch=self._name)
            self._watching.clear()
            self._stopped.wait(backoff_s)
            backoff_s = min(backoff_s * 2, self._max_backoff_s)

    def _read(self) -> tuple[list[Any], int]:
        """Every kv of the key or prefix, and the revision they are all of."""
        if self._range_end is None:
            resp = self._client.get_response(self._key)
            return list(resp.kvs), resp.header.revision
        kvs: list[Any] = []
        start, revision, limit = self._key, None, self._page_keys
        while True:
            try:
                resp = self._client.get_range_response(start, self._range_end, sort_order="ascend",
                                                       limit=limit, revision=revision)
            except grpc.RpcError as exc:  # a page of big values over the limit: fewer keys
                if _code(exc) != grpc.StatusCode.RESOURCE_EXHAUSTED or limit == 1:
                    raise
                limit = max(1, limit // 2)
                continue
            revision = revision or resp.header.revision
            kvs.extend(resp.kvs)
            if not resp.more or not resp.kvs:
                return kvs, revision
            start = resp.kvs[-1].key + b"\0"  # the next key after the last one read

    def _resync(self) -> int:
        kvs, revision = self._read()
        seen: dict[str, tuple[bytes, int, int]] = {
            _text(kv.key): (kv.value, kv.mod_revision, kv.create_revision) for kv in kvs}
        events = []
        for key in sorted(set(self._cache) - set(seen)):
            events.append(WatchEvent(DELETE, key, None, revision, resync=True))
        for key, (value, mod_rev, create_rev) in sorted(seen.items()):
            cached = self._cache.get(key)
            if cached is None or cached[1] != mod_rev:
                events.append(WatchEvent(PUT, key, value, mod_rev, create_rev, resync=True))
        self._apply(events)
        return revision

    def _stream(self, start_revision: int) -> None:
        create = etcdrpc.WatchCreateRequest(key=self._key, start_revision=start_revision)
        if self._range_end is not None:
            create.range_end = self._range_end
        requests: queue.Queue[Any] = queue.Queue()
        requests.put(etcdrpc.WatchRequest(create_request=create))
        stub = etcdrpc.WatchStub(self._client.channel)
        responses = stub.Watch(_drain(requests), metadata=self._client.metadata)
        with self._lock:
            self._responses, self._requests = responses, requests
        if self._stopped.is_set():  # stop() raced with us: it may have missed the stream
            self._close_stream()
        try:
            for rs in responses:
                if rs.created:
                    self._watching.set()
                if rs.compact_revision or rs.canceled:
                    raise _StreamBroken(f"watch cancelled (compact_revision={rs.compact_revision})")
                if rs.events:
                    self._apply([_event(ev) for ev in rs.events])
        except grpc.RpcError as exc:
            if self._stopped.is_set():
                return
            raise _StreamBroken(str(exc)) from exc
        finally:
            with self._lock:
                self._responses = self._requests = None
        raise _StreamBroken("watch stream ended")

    def _apply(self, events: list[WatchEvent]) -> None:
        if not events:
            return
        for ev in events:
            if ev.kind == PUT:
                self._cache[ev.key] = (ev.value or b"", ev.mod_revision)
            else:
                self._cache.pop(ev.key, None)
        try:
            self._callback(events)
        except Exception:  # noqa: BLE001 - a callback bug must not kill the watch
            log.exception("watch_callback_failed", watch=self._name)


def _event(ev: Any) -> WatchEvent:
    key = _text(ev.kv.key)
    if ev.type == ev.PUT:
        return WatchEvent(PUT, key, ev.kv.value, ev.kv.mod_revision, ev.kv.create_revision)
    return WatchEvent(DELETE, key, None, ev.kv.mod_revision)


def _code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    code = getattr(exc, "code", None)
    return code() if callable(code) else None


def _text(key: bytes) -> str:
    return key.decode("utf-8", "surrogateescape")


def _drain(requests: queue.Queue[Any]) -> Iterator[Any]:
    while True:
        item = requests.get()
        if item is None:
            return
        yield item
