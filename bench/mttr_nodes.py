"""Time to recover for the two-node fault classes: the leader node's daemon killed, and a
node cut off from etcd. Two `planaria serve --parallel ep` nodes in network namespaces
(bench/netns.py: root and `ip` needed), one engine each, one expert-parallel group of two
ranks over the veth network, and an etcd of their own in the root namespace at the
bridge address (the leader's node must be killable without killing etcd with it).

    sudo .venv/bin/python -m bench.mttr_nodes [--preset smollm2-moe | --model DIR] [--reps 3]
        [--classes leader-killed,node-cut-off] [--streams 4] [--dtype float32] [--json]

- ``leader-killed``: SIGKILL of the leading node's `planaria serve` (its engines and
  frontend die with it: PR_SET_PDEATHSIG). The other node's rank sees its collective fail
  at once, but nobody may write the next epoch until the dead leader's lease runs out: the
  survivor then wins the election and re-forms the group without the dead rank.
  Detection is bounded by the lease TTL (3 s): the target is the TTL + 1 s. The killed
  node is started again afterwards, and rejoins.
- ``node-cut-off``: the follower node's namespace loses its route to etcd (a blackhole
  route) while it still reaches its peer. Its leases run out, the leader re-forms the
  group without its rank, and the group moves on without waiting for that rank's vote
  (elastic/ep_engine.py sync_verdict): the stall the other node's streams see is a group
  switch. The route comes back ``--cut-s`` after the cut; the node's leases are granted
  again and its rank rejoins.

The load (a closed loop of streaming completions) goes through the surviving node's HTTP.
Measured as in bench/mttr.py: the longest stall of any stream from the fault until the
group serves again, the time until then (for node-cut-off: until the cut node's rank is
back in the group, from the moment the route came back), failed requests and texts that
differ from the fault-free offline run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.closed_loop import ClosedLoopLoad, offline_reference
from bench.mttr import Run, host, longest_stall_s, model_dir, print_report
from bench.netns import Net
from bench.serve_stack import REPO
from bench.streaming_load import request_bodies

CLASSES = ("leader-killed", "node-cut-off")
HTTP_PORT = 8000  # every port is free in a fresh namespace
CONFIG = {"max_model_len": 1024, "max_num_seqs": 32}
LEASE_TTL_S = 3.0  # the daemon's node and engine lease (elastic/membership.py default)


class Node:
    """One `planaria serve --parallel ep` in namespace ``key``."""

    def __init__(self, net: Net, key: str, model: Path, root: Path, etcd: str, env: dict) -> None:
        self.net, self.key, self.model, self.etcd, self.env = net, key, model, etcd, env
        self.root = root / key
        self.root.mkdir(parents=True, exist_ok=True)
        self.runtime = Path(tempfile.mkdtemp(prefix=f"pl-n{key}-"))
        self.host = net.addr[key]
        self.base = f"http://{self.host}:{HTTP_PORT}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Node":
        cmd = [*self.net.exec_prefix(self.key), sys.executable, "-m", "planaria.daemon.cli", "serve",
               "--model", str(self.model), "--parallel", "ep", "--node-id", self.key, "--engines", "1",
               "--max-engines", "2", "--advertise-host", self.host, "--http", f"{self.host}:{HTTP_PORT}",
               "--state-dir", str(self.root / "state"), "--runtime-dir", str(self.runtime),
               "--etcd-endpoints", self.etcd, "--engine-config-json", json.dumps(CONFIG)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=open(self.root / "serve.log", "ab"),
                                     stderr=subprocess.STDOUT)
        return self

    def status(self) -> dict | None:
        r = subprocess.run([sys.executable, "-m", "planaria.daemon.cli", "status", "--json",
                            "--runtime-dir", str(self.runtime)], cwd=REPO, capture_output=True, text=True,
                           timeout=30)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


def group_of(status: dict | None, size: int, newer_than: int = 0) -> bool:
    """This node sees a group of ``size`` ranks at an epoch after ``newer_than``, every rank
    serving it, no operation under way, and its own engines running."""
    ep = (status or {}).get("ep") or {}
    if ep.get("error") or ep.get("world_size") != size or (ep.get("epoch") or 0) <= newer_than:
        return False
    records = ep.get("engines") or {}
    return (ep.get("op") is None and all(records.get(r, {}).get("state") == "serving"
                                         and records.get(r, {}).get("epoch") == ep["epoch"] for r in ep["ranks"])
            and all(e["state"] == "running" for e in status["engines"]))


def wait_for(node: Node, predicate, timeout_s: float, what: str) -> float:
    """Polls ``node``'s status until ``predicate``; returns the time.time() it held."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate(node.status()):
                return time.time()
        except (subprocess.TimeoutExpired, json.JSONDecodeError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"node {node.key}: {what} not within {timeout_s} s; log: {node.root / 'serve.log'}")


def leader_and_follower(nodes: dict[str, Node]) -> tuple[Node, Node]:
    for key, node in nodes.items():
        if ((node.status() or {}).get("ep") or {}).get("leader"):
            return node, next(n for k, n in nodes.items() if k != key)
    raise RuntimeError("no node leads")


def run_rep(fault: str, nodes: dict[str, Node], net: Net, etcd_addr: str, bodies, reference, args) -> Run:
    leader, follower = leader_and_follower(nodes)
    survivor = follower if fault == "leader-killed" else leader
    epoch0 = survivor.status()["ep"]["epoch"]
    load = ClosedLoopLoad(survivor.base, bodies, num_streams=args.streams).start()
    try:
        load.wait_done(args.streams, timeout_s=300)
        t_fault = time.time()
        if fault == "leader-killed":
            leader.kill()
            what = f"SIGKILL of node {leader.key}'s daemon (the leader)"
            t_back = wait_for(survivor, lambda s: group_of(s, 1, epoch0), 120, "a group without the dead node")
            whole = t_back - t_fault
        else:
            net.blackhole(follower.key, etcd_addr)
            what = f"node {follower.key} cut off from etcd for {args.cut_s:g} s"
            wait_for(survivor, lambda s: group_of(s, 1, epoch0), 120, "a group without the cut-off node")
            time.sleep(max(0.0, t_fault + args.cut_s - time.time()))
            net.heal(follower.key, etcd_addr)
            t_heal = time.time()
            t_back = wait_for(survivor, lambda s: group_of(s, 2), 180, "the cut-off node back in the group")
            whole = t_back - t_heal
        load.wait_done(load.num_done + args.streams, timeout_s=300)
    finally:
        records = load.stop(timeout_s=300)
    stall = longest_stall_s(records, t_fault, t_back + 1.0)
    failed = [r for r in records if r.result.get("status") != 200 or r.result.get("error")]
    differing = [r for r in records if r not in failed and r.result["text"] != reference[r.body_index]]
    if fault == "leader-killed":  # the killed node comes back for the next repetition
        nodes[leader.key].start()
        wait_for(survivor, lambda s: group_of(s, 2), 300, "the killed node back in the group")
    return Run(fault, stall, whole, len(failed), len(differing), what,
               {"errors": [r.result.get("error") for r in failed][:3], "epoch_before": epoch0})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mttr_nodes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--preset", default="smollm2-moe")
    p.add_argument("--classes", default=",".join(CLASSES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--cut-s", type=float, default=LEASE_TTL_S + 5.0, help="how long node-cut-off lasts")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("bench.mttr_nodes: needs root and `ip` (network namespaces)", file=sys.stderr)
        return 2
    classes = [c for c in args.classes.split(",") if c]
    if any(c not in CLASSES for c in classes):
        p.error(f"classes are {', '.join(CLASSES)}")
    from planaria.elastic.etcd_server import EmbeddedEtcd

    os.environ["PLANARIA_CPU_DTYPE"] = args.dtype
    model = model_dir(args)
    root = Path(tempfile.mkdtemp(prefix="pl-mttrn-"))
    bodies = [dict(b, model=model.name) for b in request_bodies(12, (48, 96), seed=3)]
    reference = offline_reference(str(model), bodies, kv_cache_bytes=64 * 2**20, max_model_len=CONFIG["max_model_len"])
    print(f"mttr_nodes: {model} ({args.dtype}), 2 nodes x 1 engine, {args.streams} streams; host: {host()}",
          flush=True)
    net = Net().up()
    etcd = EmbeddedEtcd(root / "etcd", host=net.bridge_addr).start()
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", PLANARIA_LOG_FORMAT="json")
    nodes = {k: Node(net, k, model, root, etcd.endpoint, env) for k in ("a", "b")}
    runs: list[Run] = []
    try:
        nodes["a"].start()
        wait_for(nodes["a"], lambda s: group_of(s, 1), 300, "node a's group")
        nodes["b"].start()
        wait_for(nodes["b"], lambda s: group_of(s, 2), 300, "one group over both nodes")
        for fault in classes:
            for rep in range(args.reps):
                run = run_rep(fault, nodes, net, net.bridge_addr, bodies, reference, args)
                print(f"  {fault} #{rep + 1}: {run.note}; longest stall {run.service_s or 0:.2f}s, "
                      f"back {run.whole_s:.2f}s, {run.failed} failed, {run.differing} differing", flush=True)
                runs.append(run)
    finally:
        for node in nodes.values():
            node.stop()
            shutil.rmtree(node.runtime, ignore_errors=True)
        etcd.stop()
        net.down()
    print_report(runs, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
