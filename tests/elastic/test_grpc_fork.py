"""The supervisor forks children while its etcd client's gRPC threads run. With gRPC's fork
support on, its handler restarted event-engine threads inside the forked child, where
close_fds closed their epoll fd before exec (SIGABRT: a dead engine at start, and "skipping
fork() handlers" noise at every fork). planaria.elastic forces it off, even against an
inherited GRPC_ENABLE_FORK_SUPPORT=1; children spawned the supervisor's way under gRPC
load all start, and no fork handler runs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NUM_SPAWNS = 25

_PROBE = r"""
import os, sys, tempfile, threading
from planaria.elastic.etcd_server import EmbeddedEtcd
from planaria.elastic.membership import Membership
from planaria.daemon.children import ChildSpec, PopenSpawner
root = tempfile.mkdtemp(prefix="pl-fork-")
etcd = EmbeddedEtcd(os.path.join(root, "etcd")).start()
open(sys.argv[2], "w").write(str(etcd.pid))  # the test stops it by pid if this probe hangs
m = Membership.from_endpoints(etcd.endpoint, "fork", "n0", ttl_s=2).start()
m.watch_prefix("/planaria/fork/", lambda events: None)
stop = threading.Event()
def busy():  # keep gRPC calls in flight on other threads while we fork
    while not stop.is_set():
        try:
            m.client.get("/planaria/fork/x")
        except Exception:
            pass
threads = [threading.Thread(target=busy, daemon=True) for _ in range(2)]
for t in threads:
    t.start()
codes = []
for i in range(int(sys.argv[1])):
    child = PopenSpawner().spawn(ChildSpec(key=("engine", i), argv=[sys.executable, "-c", "pass"],
                                           log_path=os.path.join(root, f"child{i}.log")))
    codes.append(child.popen.wait(30))
stop.set()
m.close()
etcd.stop()
logs = "".join(open(os.path.join(root, f"child{i}.log")).read() for i in range(len(codes)))
print("CODES", codes, "ENV", os.environ["GRPC_ENABLE_FORK_SUPPORT"], "EPOLL", "epoll_wait error" in logs)
"""


def test_children_spawned_under_grpc_load_start_and_no_fork_handler_runs(tmp_path):
    # Without the fix the probe's children hang or abort between fork and exec.
    env = dict(os.environ, GRPC_ENABLE_FORK_SUPPORT="1", PYTHONPATH=str(REPO))
    pid_file = tmp_path / "etcd.pid"
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, str(NUM_SPAWNS), str(pid_file)], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=120)
    finally:
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("CODES"))
    assert line == f"CODES {[0] * NUM_SPAWNS} ENV false EPOLL False", line
    assert "fork_posix" not in out.stderr and "skipping fork() handlers" not in out.stderr, out.stderr[-2000:]
