"""One node's part of an expert-parallel cluster, for the supervisor to own.

    cluster = EPNode(node_id, cluster, etcd_endpoints, model_dir, launcher, ...)
    cluster.start()      # lease, node record, election, rendezvous store, controller thread
    cluster.request_scale(3)   # what `planaria scale to 3` does (any node)
    cluster.stop()

``ProcessLauncher`` starts ``python -m planaria.elastic.ep_proc`` engine processes that connect to
this node's frontend (tests/elastic/_deployment.py, for tests and bench/: the leader launches
every engine itself).
``planaria serve`` passes no launcher and ``place_engines=True``: the leader places the
engines over the nodes (the ``placement`` key) and each supervisor starts its own share.
The node record carries the node's routable ``host``, its rendezvous address and its
capacity (``engines``: its --engines, ``max_engines``); the node's thread keeps the
placement and the group's KV figure fresh (``placement``, ``kv_figure``) for the
supervisor's loop, which never waits on etcd.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import msgspec
import structlog

from planaria.elastic.controller import EPController
from planaria.elastic.election import LeaderElection
from planaria.elastic.ep import host_store
from planaria.elastic.errors import ElasticError, EtcdUnavailableError
from planaria.elastic.keys import NodeInfo
from planaria.elastic.membership import Membership
from planaria.elastic.node_view import LeaderWatch, NodeView, campaign_spread_s
from planaria.engine.models.loader import load_hf_config, model_fingerprint, spec_from_config

log = structlog.get_logger("planaria.elastic.cluster")
MIN_TICK_S = 0.005
KV_FIGURE_EVERY_S = 10.0  # the group's KV figure is read again at least this often
# A node's first etcd write waits this long for etcd to answer: an embedded etcd that has
# just said healthy over HTTP can still time out a first gRPC connection on a loaded host.
START_ETCD_WAIT_S = 20.0


class ProcessLauncher:
    """Spawns EP engine processes (real processes, new session, stopped by pid).

    ``standby(True)`` keeps one standby process (elastic/standby.py) warm: a launch hands it
    its assignment instead of starting an interpreter, and a new standby is started
    ``standby_delay_s`` later (not at once: its imports would compete for the CPU with the
    engine that is joining)."""

    def __init__(self, *, model_dir: str, engine_config: dict, input_addr: str, etcd_endpoints: list[str],
                 cluster: str, node_id: str, log_dir: Path, env: dict | None = None,
                 lease_ttl_s: float = 3.0, collective_timeout_s: float = 10.0, etcd_security=None,
                 standby_delay_s: float = 10.0) -> None:
        self.model_dir, self.engine_config, self.input_addr = model_dir, engine_config, input_addr
        self.etcd_endpoints, self.cluster, self.node_id = etcd_endpoints, cluster, node_id
        self.log_dir = Path(log_dir)
        self.env = env
        self.lease_ttl_s, self.collective_timeout_s = lease_ttl_s, collective_timeout_s
        self.etcd_security = etcd_security
        self.procs: dict[str, subprocess.Popen] = {}
        self.index_of: dict[str, int] = {}
        self._next_index = 0
        self.launch_times: dict[str, float] = {}
        self.launched_from_standby: set[str] = set()
        self.standby_delay_s = standby_delay_s
        self._standby_on = False
        self._spare: tuple[subprocess.Popen, Path] | None = None
        self._spares_made = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def _env(self) -> dict:
        env = dict(os.environ if self.env is None else self.env)
        if self.etcd_security is not None:  # TLS files and user via env; never a password on argv
            env.update(self.etcd_security.to_env())
        return env

    def __call__(self, engine_id: str, kv_cache_bytes: int | None) -> None:
        config = dict(self.engine_config, model=self.model_dir)
        if kv_cache_bytes:
            config.update(kv_cache_bytes=int(kv_cache_bytes), kv_source="reused")
        index = self._next_index
        self._next_index += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{engine_id}.log"
        args = ["--engine-index", str(index), "--engine-id", engine_id,
                "--node-id", self.node_id, "--input-addr", self.input_addr,
                "--config-json", msgspec.json.encode(config).decode(),
                "--etcd-endpoints", ",".join(self.etcd_endpoints), "--cluster", self.cluster,
                "--lease-ttl-s", str(self.lease_ttl_s), "--collective-timeout-s", str(self.collective_timeout_s)]
        proc = self._assign_spare(args, log_path)
        if proc is not None:
            self.launched_from_standby.add(engine_id)
        else:
            with open(log_path, "ab") as out:
                proc = subprocess.Popen([sys.executable, "-m", "planaria.elastic.ep_proc", *args], stdout=out,
                                        stderr=subprocess.STDOUT, env=self._env(), start_new_session=True)
        self.procs[engine_id] = proc
        self.index_of[engine_id] = index
        self.launch_times[engine_id] = time.time()
        log.info("launched EP engine", engine_id=engine_id, index=index, pid=proc.pid,
                 kv_cache_bytes=kv_cache_bytes, standby=engine_id in self.launched_from_standby)

    # -- the standby process ------------------------------------------------------------------
    def standby(self, on: bool = True) -> None:
        """Keep one warm standby process (on), or release it (off)."""
        self._standby_on = on
        if on:
            self._make_spare()
        else:
            with self._lock:
                spare, self._spare = self._spare, None
            if spare is not None:
                _release(spare[0])

    def standby_ready(self) -> bool:
        """A standby process is up and has finished warming up."""
        with self._lock:
            spare = self._spare
        if spare is None or spare[0].poll() is not None:
            return False
        try:
            return "waiting for an assignment" in spare[1].read_text(errors="replace")
        except OSError:
            return False

    def _make_spare(self) -> None:
        with self._lock:
            if not self._standby_on or (self._spare is not None and self._spare[0].poll() is None):
                return
            self._spares_made += 1
            self.log_dir.mkdir(parents=True, exist_ok=True)
            path = self.log_dir / f"standby-{self._spares_made}.log"
            with open(path, "ab") as out:
                proc = subprocess.Popen([sys.executable, "-m", "planaria.elastic.standby", "--model", self.model_dir],
                                        stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                        env=self._env(), start_new_session=True)
            self._spare = (proc, path)

    def _assign_spare(self, args: list[str], log_path: Path) -> subprocess.Popen | None:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None or spare[0].poll() is not None:
            return None
        proc, path = spare
        try:
            proc.stdin.write((json.dumps(args) + "\n").encode())
            proc.stdin.close()
        except OSError:
            _release(proc)
            return None
        path.rename(log_path)  # it keeps writing to the same file, under the engine's name
        if self._standby_on:
            self._timer = threading.Timer(self.standby_delay_s, self._make_spare)
            self._timer.daemon = True
            self._timer.start()
        return proc

    def stop_all(self, timeout_s: float = 10.0) -> None:
        self.standby(False)
        if self._timer is not None:
            self._timer.cancel()
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _release(proc: subprocess.Popen) -> None:
    """Let an unassigned standby go (EOF on its stdin), by pid if it does not."""
    try:
        proc.stdin.close()
        proc.wait(10)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


class EPNode:
    def __init__(self, node_id: str, cluster: str, etcd_endpoints: list[str], *, model_dir: str,
                 launcher: Callable[[str, int | None], None] | None, initial_engines: int, rendezvous: str,
                 block_size: int = 16, lease_ttl_s: int = 3, tick_s: float = 0.2, device_kind: str = "cpu",
                 switch_timeout_s: float = 30.0, security=None, host: str = "127.0.0.1",
                 capacity: dict[str, int] | None = None, addresses: dict[str, str] | None = None,
                 place_engines: bool = False) -> None:
        self.node_id, self.cluster = node_id, cluster
        self._wake = threading.Event()  # a change the controller or the view acts on
        self.membership = Membership.from_endpoints(etcd_endpoints, cluster, node_id, ttl_s=lease_ttl_s,
                                                    security=security)
        # After the leader key goes, each node campaigns at a random moment of a spread
        # that grows with the cluster (elastic/election.py): no herd, no wait on two nodes.
        self.election = LeaderElection(self.membership, campaign_spread_s=lambda: campaign_spread_s(
            lease_ttl_s, self.view.num_nodes))
        self.rendezvous = rendezvous
        self.host, self.capacity = host, dict(capacity or {})
        self.addresses = {"rendezvous": rendezvous, **(addresses or {})}
        self._store = None
        spec = spec_from_config(load_hf_config(model_dir))
        self.controller = EPController(
            self.membership, self.election, cluster, num_experts=spec.num_experts, rendezvous=rendezvous,
            launch=launcher, model_fingerprint=model_fingerprint(model_dir), device_kind=device_kind,
            block_size=block_size, initial_engines=initial_engines, engine_prefix=f"{node_id}-e",
            switch_timeout_s=switch_timeout_s, place_engines=place_engines)
        self.tick_s = tick_s
        self.kv_figure: int | None = None  # the group's KV figure (kv_budget), for restarts
        self.view = NodeView(self.membership, spec.num_experts, on_change=self._wake.set)
        self.leader_watch = LeaderWatch(self.membership, self.election, on_change=self._wake.set)
        self._kv_ranks: list[str] | None = None
        self._kv_read_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ep-controller", daemon=True)

    def start(self, etcd_wait_s: float = START_ETCD_WAIT_S) -> "EPNode":
        """Lease, node record, election and controller; raises EtcdUnavailableError when
        etcd does not take the node record within ``etcd_wait_s``."""
        self.membership.start()
        self.started_at = time.time()
        info = NodeInfo(node_id=self.node_id, host=self.host, addresses=self.addresses,
                        capacity=self.capacity, started_at=self.started_at)
        deadline = time.monotonic() + etcd_wait_s
        while True:
            try:
                self.membership.register_node(info)
                break
            except EtcdUnavailableError as exc:
                if time.monotonic() >= deadline:
                    raise
                log.warning("etcd not answering yet; retrying the node record", error=str(exc))
                time.sleep(0.5)
        self._store = host_store(self.rendezvous)  # serves the groups this node leads
        self.election.start()
        self._thread.start()
        return self

    def _run(self) -> None:
        """Tick the controller: at once on a change in etcd the leader must act on (its
        watch of the whole cluster prefix), and every tick_s regardless (timeouts, etcd
        coming back). Every node keeps its view (placement, node records, epoch) from
        watches of those keys alone: a follower reads nothing per tick, and only the leader
        receives the events of every engine record."""
        self.view.start()
        while not self._stop.is_set():
            self._wake.wait(self.tick_s)
            self._wake.clear()
            if self._stop.wait(MIN_TICK_S):  # a burst of changes makes one tick
                break
            self.leader_watch.follow()
            try:
                self.controller.tick()
                self._refresh_kv_figure()
            except ElasticError as exc:  # etcd down: membership changes freeze, traffic goes on
                log.warning("controller tick failed", error=str(exc))
            except Exception:
                log.exception("controller tick crashed")
        self.leader_watch.stop()

    @property
    def placement(self):
        """The leader's placement this node follows (elastic.placement.Placement; None: none
        yet), kept fresh by the view without the supervisor's loop waiting on etcd."""
        return self.view.placement

    def _refresh_kv_figure(self, every_s: float = KV_FIGURE_EVERY_S) -> None:
        """The group's KV figure (for restarts and added engines): read when the epoch
        changed, and every ``every_s`` (a figure published meanwhile)."""
        now = time.monotonic()
        if self.view.epoch_ranks == self._kv_ranks and now - self._kv_read_at < every_s:
            return
        self._kv_read_at, self._kv_ranks = now, self.view.epoch_ranks
        c = self.controller
        budget = c.kv.smallest_for_group(c.fp, c.device_kind, self._kv_ranks)
        self.kv_figure = budget.kv_cache_bytes if budget is not None else None

    def request_scale(self, target: int) -> str:
        op_id = f"op-{uuid.uuid4().hex[:8]}"
        self.controller.desired.request_scale(target, op_id, kind="scale")
        return op_id

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)
        self.election.stop()
        self.membership.close(revoke=True)
        self._store = None

