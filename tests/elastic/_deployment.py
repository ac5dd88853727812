"""A one-node expert-parallel deployment assembled from real parts, for tests and bench/
(bench/scale_up.py; bench runs from the repository root, where ``tests`` imports):
an embedded etcd, the HTTP frontend process, EP engine processes, and an EPNode (lease,
election, controller). A watcher thread plays the supervisor's part for engines: when an
engine process exits it reports ENGINE_CORE_DEAD to the frontend (a SIGKILLed engine
cannot) and deletes its etcd record at once.

``planaria serve --parallel ep`` wires the same parts into the supervisor.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import zmq

from planaria.common.sockets import ipc_addresses
from planaria.elastic.cluster import EPNode, ProcessLauncher
from planaria.elastic.etcd_server import EmbeddedEtcd
from planaria.elastic.keys import KeyLayout
from planaria.elastic.membership import forget_engine
from planaria.engine.death_reporter import DeathReporter


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class EPDeployment:
    def __init__(self, root: Path, model: str, num_engines: int = 2, cluster: str = "c1",
                 engine_config: dict | None = None, etcd_endpoints: list[str] | None = None,
                 engine_lease_ttl_s: float = 3.0, collective_timeout_s: float = 10.0,
                 switch_timeout_s: float = 30.0, etcd_security=None) -> None:
        self.root = Path(root)
        self.model, self.num_engines, self.cluster = model, num_engines, cluster
        self.engine_config = engine_config or {"max_num_seqs": 16, "max_model_len": 1024}
        self.etcd = None if etcd_endpoints else EmbeddedEtcd(self.root / "etcd")
        self._endpoints = etcd_endpoints
        self.engine_lease_ttl_s, self.collective_timeout_s = engine_lease_ttl_s, collective_timeout_s
        self.switch_timeout_s = switch_timeout_s
        self.etcd_security = etcd_security
        self.http_port = free_port()
        self.fe = None
        self.node = None
        self.launcher = None
        self._stop = threading.Event()
        self._watcher = None
        self.deaths: list[tuple[str, float]] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout_s: float = 180) -> "EPDeployment":
        if self.etcd is not None:
            self.etcd.start()
        endpoints = self._endpoints or [self.etcd.endpoint]
        rt = Path(f"/tmp/pl-{os.getpid()}-{free_port()}")  # ipc paths must stay short
        rt.mkdir(mode=0o700)
        self.runtime_dir = rt
        self.fe = subprocess.Popen(
            [sys.executable, "-m", "planaria.frontend.main", "--model", self.model, "--http", f"127.0.0.1:{self.http_port}",
             "--runtime-dir", str(rt), "--engines", str(self.num_engines)],
            stdout=open(self.root / "frontend.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        self.input_addr, self.output_addr = ipc_addresses(rt)
        self.launcher = ProcessLauncher(model_dir=self.model, engine_config=self.engine_config,
                                        input_addr=self.input_addr, etcd_endpoints=endpoints,
                                        cluster=self.cluster, node_id="n0", log_dir=self.root / "engines",
                                        lease_ttl_s=self.engine_lease_ttl_s,
                                        collective_timeout_s=self.collective_timeout_s,
                                        etcd_security=self.etcd_security)
        self.node = EPNode("n0", self.cluster, endpoints, model_dir=self.model, launcher=self.launcher,
                           initial_engines=self.num_engines, rendezvous=f"127.0.0.1:{free_port()}",
                           switch_timeout_s=self.switch_timeout_s, security=self.etcd_security).start()
        self._watcher = threading.Thread(target=self._watch, name="ep-watch", daemon=True)
        self._watcher.start()
        self.wait_serving(self.num_engines, timeout_s)
        return self

    def _watch(self) -> None:
        ctx = zmq.Context.instance()
        report = DeathReporter(ctx, self.output_addr)
        reported: set[str] = set()
        layout = KeyLayout(self.cluster)
        while not self._stop.wait(0.005):
            for eid, p in list(self.launcher.procs.items()):
                if eid in reported or p.poll() is None:
                    continue
                reported.add(eid)
                self.deaths.append((eid, time.time()))
                if p.returncode != 0:  # a clean exit (scale-down) already said goodbye
                    report(self.launcher.index_of[eid], p.pid, f"engine exited with {p.returncode}")
                try:
                    forget_engine(self.node.membership.client, layout, eid, p.pid)
                except Exception:  # etcd down: the engine's lease expires on its own
                    pass
        report.close()

    def epoch(self):
        return self.node.controller.epochs.read_epoch()[0]

    def wait_serving(self, world_size: int, timeout_s: float = 120, newer_than: int = 0, poll_s: float = 0.1):
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            try:
                ep = self.epoch()
                recs = {r.engine_id: r for r in self.node.membership.list_engines()}
            except Exception:
                time.sleep(0.2)
                continue
            if ep and ep.number > newer_than and ep.world_size == world_size and all(
                    e in recs and recs[e].epoch == ep.number and recs[e].state == "serving" for e in ep.ranks) \
                    and self.node.controller.desired.active_op() is None \
                    and self.frontend_healthy() >= world_size:
                return ep, time.time() - t0
            time.sleep(poll_s)
        raise TimeoutError(f"no serving epoch of {world_size} ranks within {timeout_s} s; "
                           f"controller: {self.node.controller.last_action}")

    def frontend_healthy(self) -> int:
        """How many engines the frontend routes to (READY comes once a rank is in a group)."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/ready", timeout=2) as r:
                return int(json.loads(r.read())["num_healthy_engines"])
        except urllib.error.HTTPError as exc:
            return int(json.loads(exc.read()).get("num_healthy_engines", 0))
        except (OSError, ValueError):
            return 0

    def scale(self, target: int) -> str:
        return self.node.request_scale(target)

    def kill_rank(self, rank: int, sig=signal.SIGKILL) -> str:
        eid = self.epoch().ranks[rank]
        os.kill(self.launcher.procs[eid].pid, sig)
        return eid

    def close(self) -> None:
        self._stop.set()
        if self.node is not None:
            self.node.stop()
        if self.launcher is not None:
            self.launcher.stop_all()
        if self.fe is not None:
            self.fe.terminate()
            try:
                self.fe.wait(15)
            except subprocess.TimeoutExpired:
                self.fe.kill()
        if self.etcd is not None:
            self.etcd.stop()
        shutil.rmtree(getattr(self, "runtime_dir", "/nonexistent"), ignore_errors=True)
