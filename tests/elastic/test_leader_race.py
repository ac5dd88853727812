"""Two real leader controllers (two processes, each an EPNode: lease, election, rendezvous
store, the controller thread) race for the leadership of one cluster on one etcd.

Exactly one wins. The winner is then paused (SIGSTOP) between deciding on an epoch and
writing it — the classic stop-the-world pause — for longer than its lease TTL; the other
takes over and writes that epoch itself. When the old leader wakes up and writes, the
fence (create revision of the leader key, in the same transaction) refuses it. etcd's own
history shows every epoch written by the node that held the leader key at that revision.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from planaria.elastic.desired import DesiredStore
from planaria.elastic.keys import EngineRecord, EngineRecordState, Epoch, KeyLayout, decode
from planaria.elastic.membership import Membership
from planaria.elastic.watch import PUT, KeyWatch
from tests.elastic.conftest import wait_for

REPO = Path(__file__).resolve().parents[2]
TTL_S = 2

_CONTROLLER = """
import os, signal, sys, threading, time
from pathlib import Path
from planaria.elastic.cluster import EPNode
endpoint, cluster, node_id, model, rendezvous, pause_file, start_at = sys.argv[1:8]


def say(*parts):
    # one write, on a line of its own: the node's log lines (other threads, same stdout) are
    # printed in two writes, and a marker could otherwise land behind half of one
    sys.stdout.write("\\n" + " ".join(map(str, parts)) + "\\n")
    sys.stdout.flush()

node = EPNode(node_id, cluster, [endpoint], model_dir=model, launcher=None, initial_engines=2,
              rendezvous=rendezvous, lease_ttl_s=%d, tick_s=0.1, switch_timeout_s=600)
real_write = node.controller.epochs.write_epoch

def write_epoch(epoch, rev, token, *rest):
    if epoch.number >= 2 and Path(pause_file).exists():   # pause between deciding and writing
        Path(pause_file).unlink()
        say("PAUSED_BEFORE_WRITE", epoch.number, token)
        # Thread-directed, then a syscall: this thread stops here, before the write is sent
        # (a process-directed SIGSTOP may let it run on into the RPC for a moment).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        time.sleep(0.2)
        say("RESUMED")
    try:
        out = real_write(epoch, rev, token, *rest)
    except Exception as exc:
        say("EPOCH_REFUSED", epoch.number, type(exc).__name__, exc)
        raise
    say("EPOCH_WRITTEN", epoch.number, token)
    return out

node.controller.epochs.write_epoch = write_epoch
time.sleep(max(0.0, float(start_at) - time.time()))
node.start()
say("STARTED")

def actions():
    last = None
    while True:
        if node.controller.last_action != last:
            last = node.controller.last_action
            say("ACTION", last)
        time.sleep(0.05)

import threading
threading.Thread(target=actions, daemon=True).start()
sys.stdin.read()
node.stop()
""" % TTL_S


class Controller:
    def __init__(self, node_id: str, endpoint: str, cluster: str, model: str, root: Path, start_at: float):
        from tests.elastic._deployment import free_port

        self.node_id = node_id
        self.pause_file = root / f"pause-{node_id}"
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CONTROLLER, endpoint, cluster, node_id, model, f"127.0.0.1:{free_port()}",
             str(self.pause_file), str(start_at)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def said(self, prefix: str) -> list[str]:
        return [line for line in self.lines if line.startswith(prefix)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_two_controllers_race_and_a_paused_leader_is_fenced(etcd_server, client, cluster, tiny_moe, tmp_path):
    layout = KeyLayout(cluster)
    history: list[tuple[str, int, str]] = []  # (key, mod revision, value): leader and epoch PUTs

    def record(events):
        for ev in events:
            if ev.kind == PUT:
                history.append((ev.key, ev.mod_revision, ev.value.decode()))
            else:
                history.append((ev.key, ev.mod_revision, ""))

    watches = [KeyWatch(client, k, record, prefix=False).start() for k in (layout.leader, layout.epoch)]
    for w in watches:
        assert w.wait_watching(5)
    # Two live engines (records only: no engine process is needed to plan epochs).
    engines = Membership.from_endpoints(etcd_server.endpoint, cluster, "engines", ttl_s=10).start()

    def engine(eid: str, state: EngineRecordState, epoch: int = 0) -> None:
        engines.put_engine(EngineRecord(engine_id=eid, node_id="x", state=state, epoch=epoch,
                                        served_epoch=epoch, rank=None))
    engine("e0", EngineRecordState.READY)
    engine("e1", EngineRecordState.READY)
    start_at = time.time() + 8.0  # both campaign at once, after their imports
    nodes = [Controller(n, etcd_server.endpoint, cluster, tiny_moe, tmp_path, start_at) for n in ("a", "b")]
    try:
        assert wait_for(lambda: all(c.said("STARTED") for c in nodes), timeout_s=60), [c.lines[-5:] for c in nodes]
        assert wait_for(lambda: client.get(layout.leader)[0] is not None, timeout_s=10)
        leader_id = client.get(layout.leader)[0].decode()
        leader = next(c for c in nodes if c.node_id == leader_id)
        other = next(c for c in nodes if c is not leader)
        # The leader forms epoch 1 from the two live engines; nobody else writes.
        assert wait_for(lambda: leader.said("EPOCH_WRITTEN 1"), timeout_s=10), leader.lines[-5:]
        time.sleep(1.0)
        assert not other.said("EPOCH_WRITTEN") and client.get(layout.leader)[0].decode() == leader_id
        engine("e0", EngineRecordState.SERVING, 1)
        engine("e1", EngineRecordState.SERVING, 1)

        # Scale to 1: the leader decides on epoch 2 and is paused before it writes.
        leader.pause_file.touch()
        DesiredStore(client, cluster).request_scale(1, "op-race")
        assert wait_for(lambda: leader.said("PAUSED_BEFORE_WRITE 2"), timeout_s=10), leader.lines[-5:]
        assert wait_for(lambda: psutil.Process(leader.proc.pid).status() == psutil.STATUS_STOPPED, timeout_s=5)
        # Past the lease TTL the other takes over and writes epoch 2 itself.
        assert wait_for(lambda: other.said("EPOCH_WRITTEN 2"), timeout_s=TTL_S + 10), other.lines[-8:]
        assert client.get(layout.leader)[0].decode() == other.node_id
        epoch_b, meta_b = client.get(layout.epoch)
        assert decode(layout.epoch, epoch_b, Epoch).leader == other.node_id

        # The old leader wakes up and writes what it decided: the fence refuses it.
        os.kill(leader.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: leader.said("EPOCH_REFUSED 2"), timeout_s=10), leader.lines[-5:]
        assert "StaleLeaderError" in leader.said("EPOCH_REFUSED 2")[0]
        time.sleep(2 * TTL_S)  # it campaigns again, and loses: the other holds the key
        assert client.get(layout.leader)[0].decode() == other.node_id
        value, meta = client.get(layout.epoch)
        assert meta.mod_revision == meta_b.mod_revision  # nothing overwrote epoch 2
        assert not leader.said("EPOCH_WRITTEN 2") and not any(
            line.split()[1] != "1" for line in leader.said("EPOCH_WRITTEN"))
        # The old leader's election went on campaigning through its expired lease: when the
        # new leader goes, it leads again.
        other.stop()
        assert wait_for(lambda: (client.get(layout.leader)[0] or b"").decode() == leader_id, timeout_s=TTL_S + 5)
    finally:
        for c in nodes:
            c.stop()
            (tmp_path / f"{c.node_id}.out").write_text("\n".join(c.lines))
            print(f"--- {c.node_id}", *c.lines[-30:], sep="\n")
        for w in watches:
            w.stop()
        engines.close()

    # etcd's history: every epoch was written by the holder of the leader key at that time.
    holder, holders_seen, epochs = None, [], []
    for key, _rev, value in sorted(history, key=lambda h: h[1]):
        if key == layout.leader:
            holder = value or None
            if holder:
                holders_seen.append(holder)
        else:
            e = decode(key, value.encode(), Epoch)
            epochs.append((e.number, e.leader))
            assert e.leader == holder, (e.number, e.leader, holder)
    assert epochs == [(1, leader_id), (2, other.node_id)]
    assert holders_seen[:2] == [leader_id, other.node_id]
