"""The worker processes of bench/membership_scale.py, both halves: ``Worker`` (in the
process) and ``WorkerPool`` (the bench's side).

A worker process (``python -m bench.membership_workers --config-json SIMCONFIG``;
``WorkerPool`` starts them, each in its own session, and stops them by pid) hosts many
simulated nodes (bench/membership_sim.py) and answers one JSON line on stdout per JSON
command line on stdin::

    {"op": "start", "nodes": ["n000", ...]}   -> {"started": {node: t_monotonic}}
    {"op": "crash", "node": "n007"}           -> {"t_crash": t, "lease_valid_until": t}
    {"op": "restart", "node": "n007"}         -> {"started": {...}}
    {"op": "campaigns"}                       -> {"campaigns": [[t, node], ...]}
    {"op": "leaders"}                         -> {"leaders": [node, ...]} (believed)
    {"op": "usage"}                           -> {"threads": n, "cpu_s": s, "rss_bytes": b}
    {"op": "stop"}                            -> {"stopped": n} and the process exits

Several processes rather than one: every node has about 10 threads, and one interpreter
lock over a few hundred of them thrashes (16 nodes per worker by default).
"""

from __future__ import annotations

import argparse
import json
import queue
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from bench.membership_sim import SimConfig, SimNode
from planaria.common.logging import configure
from planaria.elastic.errors import ElasticError


class Worker:
    """The nodes of one worker process, driven by JSON commands (module docstring)."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.nodes: dict[str, SimNode] = {}
        self.campaigns: list[tuple[float, str]] = []

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command.get("op")
        if op == "start" or op == "restart":
            names = command["nodes"] if op == "start" else [command["node"]]
            return {"started": {name: self._start(name) for name in names}}
        if op == "crash":
            return self.nodes.pop(command["node"]).crash()
        if op == "campaigns":
            return {"campaigns": list(self.campaigns)}
        if op == "leaders":
            return {"leaders": [n for n, node in self.nodes.items() if node.election.is_leader]}
        if op == "usage":
            usage = resource.getrusage(resource.RUSAGE_SELF)
            return {"threads": threading.active_count(), "cpu_s": usage.ru_utime + usage.ru_stime,
                    "rss_bytes": usage.ru_maxrss * 1024}
        if op == "stop":
            return {"stopped": self.stop_all()}
        return {"error": f"unknown op {op!r}"}

    def _start(self, name: str) -> float:
        node = SimNode(self.config, name, int(name.lstrip("n") or 0), self.campaigns)
        try:
            started_at = node.start()
        except ElasticError:
            node.stop()
            raise
        self.nodes[name] = node
        return started_at

    def stop_all(self) -> int:
        nodes, self.nodes = list(self.nodes.values()), {}
        for node in nodes:
            node.stop()
        return len(nodes)


def worker_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.membership_workers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-json", required=True, help="a SimConfig as JSON")
    args = p.parse_args(argv)
    configure(level="WARNING", stream=sys.stderr)
    worker = Worker(msgspec.json.decode(args.config_json, type=SimConfig))
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        command = json.loads(line)
        try:
            reply = worker.handle(command)
        except (ElasticError, KeyError, ValueError) as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if command.get("op") == "stop":
            break
    worker.stop_all()
    return 0


class WorkerPool:
    """The bench's side of the workers: ``num_workers`` processes (own session, stopped by
    pid), each hosting a share of the nodes; ``call`` sends a command and waits for its
    reply with a deadline. A worker's log (stderr) is ``log_dir/worker-<i>.log``."""

    def __init__(self, config: SimConfig, num_workers: int, log_dir: Path) -> None:
        self.config = config
        self.log_dir = log_dir
        self._procs: list[subprocess.Popen[str]] = []
        self._replies: list[queue.Queue[dict[str, Any]]] = []
        self.num_workers = num_workers
        self.home: dict[str, int] = {}  # node id -> worker index

    def start(self, timeout_s: float = 60.0) -> WorkerPool:
        cmd = [sys.executable, "-m", "bench.membership_workers", "--config-json",
               msgspec.json.encode(self.config).decode()]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.num_workers):
            with open(self.log_dir / f"worker-{i}.log", "ab") as err:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                        text=True, bufsize=1, start_new_session=True)
            replies: queue.Queue[dict[str, Any]] = queue.Queue()
            threading.Thread(target=_read_replies, args=(proc, replies), daemon=True,
                             name=f"worker-{i}-replies").start()
            self._procs.append(proc)
            self._replies.append(replies)
        for i in range(self.num_workers):
            self._reply(i, timeout_s)  # {"ready": true}
        return self

    def call(self, worker: int, command: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self._send(worker, command)
        reply = self._reply(worker, timeout_s)
        if "error" in reply:
            raise RuntimeError(f"worker {worker}: {command.get('op')}: {reply['error']}")
        return reply

    def call_all(self, command: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        return [self.call(i, command, timeout_s) for i in range(self.num_workers)]

    def start_nodes(self, node_ids: list[str], timeout_s: float) -> dict[str, float]:
        """Start ``node_ids`` spread round-robin over the workers, all workers at once."""
        shares: list[list[str]] = [node_ids[i::self.num_workers] for i in range(self.num_workers)]
        for i, share in enumerate(shares):
            for node_id in share:
                self.home[node_id] = i
        started: dict[str, float] = {}
        for i, share in enumerate(shares):  # send every command first: the workers start in parallel
            self._send(i, {"op": "start", "nodes": share})
        for i in range(self.num_workers):
            reply = self._reply(i, timeout_s)
            if "error" in reply:
                raise RuntimeError(f"worker {i}: start: {reply['error']}")
            started.update(reply["started"])
        return started

    def _send(self, worker: int, command: dict[str, Any]) -> None:
        stdin = self._procs[worker].stdin
        if stdin is None:
            raise RuntimeError(f"worker {worker} has no stdin")
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    def _reply(self, worker: int, timeout_s: float) -> dict[str, Any]:
        try:
            return self._replies[worker].get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"worker {worker} did not answer within {timeout_s:g} s "
                               f"(log: {self.log_dir / f'worker-{worker}.log'})") from None

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop every node (leases revoked), then the processes; SIGKILL by pid if need be."""
        for i, proc in enumerate(self._procs):
            if proc.poll() is None:
                try:
                    self._send(i, {"op": "stop"})
                except (OSError, RuntimeError):
                    continue
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _read_replies(proc: subprocess.Popen[str], replies: queue.Queue[dict[str, Any]]) -> None:
    if proc.stdout is None:
        return
    for line in proc.stdout:
        replies.put(json.loads(line))


if __name__ == "__main__":
    sys.exit(worker_main())
