"""A KeyWatch on a prefix holding more than gRPC's 4 MiB message limit, against a real etcd.

Its (re)sync read used to be one Range of the whole prefix: past 4 MiB etcd's answer is
refused by the client (RESOURCE_EXHAUSTED) and the watch retried forever without ever
starting. A cluster's prefix can get there by itself: bench/membership_scale.py found the
ops/ records of finished scale operations are never deleted (about 156 B each, so some
25 000 of them make 4 MiB with nothing else), and every node watches the whole prefix.
"""

from __future__ import annotations

import threading

from planaria.elastic.watch import DELETE, KeyWatch, WatchEvent
from tests.elastic.conftest import wait_for

NUM_KEYS = 48
VALUE_BYTES = 120_000  # 48 x 120 KB: about 5.5 MiB under the prefix


def test_watch_starts_on_a_prefix_over_the_message_limit(client, cluster):
    prefix = f"/t/{cluster}/big/"
    for i in range(NUM_KEYS):
        client.put(f"{prefix}{i:03d}", bytes([65 + i % 26]) * VALUE_BYTES)
    seen: dict[str, bytes | None] = {}
    lock = threading.Lock()

    def record(events: list[WatchEvent]) -> None:
        with lock:
            for ev in events:
                seen[ev.key] = None if ev.kind == DELETE else ev.value

    watch = KeyWatch(client, prefix, record).start()
    try:
        assert watch.wait_watching(10), "the watch never started"
        with lock:
            assert sorted(seen) == [f"{prefix}{i:03d}" for i in range(NUM_KEYS)]
            assert all(len(v or b"") == VALUE_BYTES for v in seen.values())
        client.put(f"{prefix}zzz", b"after")  # and it streams from the read's revision on
        client.delete(f"{prefix}000")
        assert wait_for(lambda: seen.get(f"{prefix}zzz") == b"after" and seen.get(f"{prefix}000", b"") is None,
                        timeout_s=5)
    finally:
        watch.stop()
        for i in range(NUM_KEYS):
            client.delete(f"{prefix}{i:03d}")
        client.delete(f"{prefix}zzz")
