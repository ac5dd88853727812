"""`planaria serve --parallel ep`'s embedded etcd for real: authenticated by default (a root
credential in the state dir, 0600, on no command line; an anonymous client is refused) and
supervised: SIGKILLed mid-load, requests keep completing, it comes back (new pid, shown by
`planaria status`), membership re-converges (leader, node and engine records) and a
`planaria scale` up right after succeeds. SIGKILL of the daemon takes etcd with it."""

from __future__ import annotations

import os
import signal
import stat
import time

import psutil
import pytest

from tests.elastic.conftest import wait_for
from tests.integration.test_supervisor import Daemon, _stop_tree

pytestmark = pytest.mark.timeout(600)


def _group(s: dict, n: int) -> bool:
    ep = s.get("ep") or {}
    return (not ep.get("error") and ep.get("world_size") == n and ep.get("op") is None and s["num_up"] == n
            and all(ep["engines"].get(r, {}).get("state") == "serving" for r in ep["ranks"]))


def _converged(s: dict, old_pid: int) -> bool:
    """etcd is back (a new pid) and the cluster's view of itself is whole again: this node
    leads, its node record and every rank's serving record are there."""
    ep = s.get("ep") or {}
    etcd = ep.get("etcd") or {}
    return (etcd.get("state") == "running" and etcd.get("pid") not in (None, old_pid) and _group(s, 2)
            and ep.get("leader") and ep.get("node_id") in (ep.get("nodes") or {}))


def test_embedded_etcd_is_authenticated_and_supervised(tiny_moe, tmp_path):
    from bench.closed_loop import ClosedLoopLoad, mismatches, offline_reference
    from bench.streaming_load import request_bodies
    from planaria.elastic.errors import EtcdAuthError
    from planaria.elastic.etcd_client import etcd_call, make_client

    bodies = request_bodies(8, (32, 64), seed=5)
    reference = offline_reference(tiny_moe, bodies, kv_cache_bytes=16 * 2**20, max_model_len=256)
    d = Daemon(tiny_moe, tmp_path / "serve", extra_args=("--parallel", "ep", "--max-engines", "3"))
    try:
        s = d.wait(lambda s: _group(s, 2), 240, "EP group of 2")
        etcd = s["ep"]["etcd"]
        assert etcd["state"] == "running" and etcd["restarts"] == 0, etcd
        # Auth by default: the credential is private, on no command line, and required.
        password_file = d.state / "etcd" / "root.password"
        assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
        password = password_file.read_text().strip()
        for p in [psutil.Process(d.proc.pid), *psutil.Process(d.proc.pid).children(recursive=True)]:
            assert password not in " ".join(p.cmdline())
        anonymous = make_client(etcd["endpoint"])
        try:
            with pytest.raises(EtcdAuthError), etcd_call("get"):
                anonymous.get_prefix("/planaria/")
        finally:
            anonymous.close()

        load = ClosedLoopLoad(d.base, bodies, num_streams=4).start()
        try:
            load.wait_done(4)
            killed_at = time.time()
            os.kill(etcd["pid"], signal.SIGKILL)
            down = d.wait(lambda s: ((s.get("ep") or {}).get("etcd") or {}).get("pid") != etcd["pid"], 60,
                          "status to see etcd's exit or its new pid")
            back = d.wait(lambda s: (s["ep"].get("etcd") or {}).get("state") == "running"
                          and s["ep"]["etcd"]["pid"] not in (None, etcd["pid"]), 60, "etcd back")
            back_at = time.time()
            s = d.wait(lambda s: _converged(s, etcd["pid"]), 60, "membership re-converged")
            converged_s = time.time() - back_at
            print(f"etcd back {back_at - killed_at:.2f}s after SIGKILL; membership re-converged "
                  f"{converged_s:.2f}s after its return")
            assert s["ep"]["etcd"]["restarts"] == 1 and s["ep"]["etcd"]["last_exit"] == "killed by SIGKILL"
            assert "etcd (embedded): running pid" in d.cli("status").stdout
            r = d.cli("scale", "to", "3", "--wait", timeout_s=300)
            assert r.returncode == 0, r.stdout + r.stderr + d.logs()[-3000:]
            d.wait(lambda s: _group(s, 3), 240, "EP group of 3")
            load.wait_done(load.num_done + 4)
        finally:
            records = load.stop()
        assert not mismatches(records, reference), mismatches(records, reference)[:3]
        assert load.in_flight_across(killed_at), "no request was in flight when etcd died"
        assert [r for r in records if killed_at < r.ended_at], "no request finished after etcd died"
        assert down is not None and back is not None
        assert converged_s < 10.0  # measured with `planaria status` polls (each ~1 s on a loaded host)

        new_etcd = psutil.Process(s["ep"]["etcd"]["pid"])
        d.proc.kill()  # SIGKILL: no shutdown path runs; etcd dies with the daemon
        d.proc.wait(10)
        assert wait_for(lambda: not new_etcd.is_running() or new_etcd.status() == psutil.STATUS_ZOMBIE, 20), \
            "the embedded etcd outlived its SIGKILLed daemon"
    finally:
        _stop_tree(d.proc)
