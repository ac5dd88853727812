"""The embedded etcd compacts its own history, so its database does not grow forever.

Without compaction etcd keeps every revision of every key: each epoch, engine record and
op a cluster ever wrote, until the database reaches the quota and etcd refuses writes
(bench/membership_scale.py: an epoch switch at 256 nodes is about 260 revisions and
100-120 KB more database).
"""

from __future__ import annotations

import urllib.request

from planaria.elastic.etcd_client import make_client
from planaria.elastic.etcd_server import EmbeddedEtcd
from planaria.elastic.watch import KeyWatch
from tests.elastic.conftest import _require_etcd, wait_for


def _compact_revision(etcd: EmbeddedEtcd) -> int:
    with urllib.request.urlopen(f"http://{etcd.endpoint}/metrics", timeout=5) as resp:  # noqa: S310 - loopback
        for line in resp.read().decode().splitlines():
            if line.startswith("etcd_debugging_mvcc_compact_revision "):
                return int(float(line.split()[-1]))
    return 0


def test_embedded_etcd_compacts_by_default(tmp_path):
    command = EmbeddedEtcd(tmp_path / "etcd").command()
    assert "--auto-compaction-mode=periodic" in command
    assert "--auto-compaction-retention=1h" in command
    never = EmbeddedEtcd(tmp_path / "e2", compaction_retention=None).command()
    assert not any("auto-compaction" in arg for arg in never)


def test_history_is_compacted_and_watches_go_on(tmp_path):
    _require_etcd()
    seen: list[bytes | None] = []
    with EmbeddedEtcd(tmp_path / "etcd", compaction_retention="1s") as etcd:
        client = make_client(etcd.endpoint)
        watch = KeyWatch(client, "/c/k", lambda events: seen.extend(e.value for e in events), prefix=False).start()
        try:
            assert watch.wait_watching(5)
            for i in range(10):
                client.put("/c/k", str(i))
            assert wait_for(lambda: _compact_revision(etcd) > 0, timeout_s=15, interval_s=0.2)
            client.put("/c/k", "after")
            assert wait_for(lambda: seen[-1:] == [b"after"], timeout_s=5)
        finally:
            watch.stop()
            client.close()
