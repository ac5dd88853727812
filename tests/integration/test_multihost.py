"""Two hosts, simulated with network namespaces: one `planaria serve --parallel ep` in each,
sharing node A's embedded etcd, forming one expert-parallel group over the veth network.

    root ns: bridge 10.77.N.254/24 --- veth --- ns A: 10.77.N.1 (etcd, leader, rendezvous)
                                   \\-- veth --- ns B: 10.77.N.2 (--etcd-endpoints 10.77.N.1:2379)

Each namespace has its own loopback, so nothing but the veth network joins them: node B's
rank reaches node A's etcd, rendezvous store and gloo peer only at 10.77.N.x. The test
process (root ns) reaches both nodes' HTTP through the bridge and their admin sockets
through the filesystem (ipc). Needs root and `ip`; the namespaces, the bridge and every
process are removed at the end (processes by pid).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench.netns import Net
from tests.integration.test_supervisor import ENGINE_CONFIG, PLANARIA, REPO, Daemon, _stop_tree

pytestmark = pytest.mark.timeout(420)
PROMPT = {"model": "tiny-moe", "prompt": "def main(argv):", "max_tokens": 12, "temperature": 0.0,
          "ignore_eos": True}
HTTP_PORT, ETCD_PORT = 8000, 2379  # fixed: every port is free in a fresh namespace
# The first ranks profile (so the group's KV figure is published in etcd), and a rank added
# or restarted on either node takes that figure instead ("reused").
PROFILED_CONFIG = {k: v for k, v in ENGINE_CONFIG.items() if k != "kv_cache_bytes"}


@pytest.fixture(scope="module")
def net():
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    if shutil.which("ip") is None:
        pytest.skip("needs the `ip` command (iproute2)")
    try:
        n = Net()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    try:
        try:
            n.up()
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
        probe = subprocess.run(["ip", "netns", "exec", n.ns["b"], sys.executable, "-c",
                                f"import socket; socket.create_connection(('{n.addr['a']}', 9), 2)"],
                               capture_output=True, text=True, timeout=30)
        if "refused" not in probe.stderr:  # a RST from ns A: the two hosts see each other
            pytest.skip(f"namespaces cannot reach each other over the bridge: {probe.stderr[-300:]}")
        yield n
    finally:
        n.down()


class NodeDaemon(Daemon):
    """`planaria serve --parallel ep` inside namespace ``key`` of ``net``."""

    def __init__(self, net: Net, key: str, model: str, root: Path, *args: str) -> None:
        self.root, self.state = root, root / "state"
        self.runtime = Path(tempfile.mkdtemp(prefix=f"pl-mh{key}-"))
        self.host = net.addr[key]
        self.base = f"http://{self.host}:{HTTP_PORT}"
        self.env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                        PLANARIA_LOG_FORMAT="json")
        self.log_path = root / "serve.log"
        root.mkdir(parents=True, exist_ok=True)
        cmd = ["ip", "netns", "exec", net.ns[key], *PLANARIA, "serve", "--model", model,
               "--parallel", "ep", "--node-id", key, "--engines", "1", "--max-engines", "2",
               "--advertise-host", self.host, "--http", f"{self.host}:{HTTP_PORT}",
               "--state-dir", str(self.state), "--runtime-dir", str(self.runtime),
               "--engine-config-json", json.dumps(PROFILED_CONFIG), "--hang-timeout-s", "5",
               "--heartbeat-interval-s", "0.25", "--restart-backoff-s", "0.2", "--stop-timeout-s", "10",
               "--stable-s", "1", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=open(self.log_path, "wb"),
                                     stderr=subprocess.STDOUT)

    def ready(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{self.base}/ready", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def nodes(net, tiny_moe, tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    started: list[NodeDaemon] = []
    try:
        a = NodeDaemon(net, "a", tiny_moe, root / "a", "--etcd-listen", f"{net.addr['a']}:{ETCD_PORT}")
        started.append(a)
        a.wait(lambda s: s.get("ep") is not None, 120, "node A's etcd and control socket")
        # node A's embedded etcd has auth on and, beyond loopback, TLS with a CA of its own:
        # node B joins with its root credential and that CA
        b = NodeDaemon(net, "b", tiny_moe, root / "b", "--etcd-endpoints", f"{net.addr['a']}:{ETCD_PORT}",
                       "--etcd-user", "root", "--etcd-password-file",
                       str(root / "a" / "state" / "etcd" / "root.password"),
                       "--etcd-ca-cert", str(root / "a" / "state" / "etcd" / "tls" / "ca.crt"))
        started.append(b)
        s = b.wait(lambda s: _group(s, {"a": 1, "b": 1}), 240, "one EP group of 2 ranks over nodes a and b")
        yield a, b
    finally:
        for d in reversed(started):
            _stop_tree(d.proc)
            shutil.rmtree(d.runtime, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tiny_moe):
    from planaria.engine import LLM, SamplingParams

    llm = LLM(tiny_moe, kv_cache_bytes=16 * 2**20, max_model_len=256)
    return llm.generate([PROMPT["prompt"]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].text


def _group(s: dict, placement: dict[str, int]) -> bool:
    """An EP group of sum(placement) ranks, placed so, every rank serving, no op running, and
    this node's engines running as its supervisor sees them."""
    ep = s.get("ep") or {}
    if ep.get("error") or ep.get("placement") != placement or ep.get("op") is not None:
        return False
    records = ep.get("engines") or {}
    on_node = [records.get(r, {}).get("node_id") for r in ep.get("ranks", [])]
    return (ep.get("world_size") == sum(placement.values())
            and all(records.get(r, {}).get("state") == "serving" for r in ep["ranks"])
            and all(on_node.count(n) == c for n, c in placement.items())
            and all(e["state"] == "running" for e in s["engines"]))


def _text(d: NodeDaemon, body: dict = PROMPT) -> str:
    status, body = d.http("/v1/completions", body)
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


def test_two_nodes_form_one_group_and_serve_the_single_engine_output(nodes, reference):
    a, b = nodes
    s = a.status()
    ep = s["ep"]
    assert ep["leader"] and not b.status()["ep"]["leader"]
    assert ep["nodes"]["a"]["host"] == a.host and ep["nodes"]["b"]["host"] == b.host
    assert ep["desired"] is None and ep["placement"] == {"a": 1, "b": 1}  # the nodes' --engines
    assert sorted(ep["ranks"]) == ["a-e0", "b-e0"]
    # Node A's engine profiles; node B starts after A's etcd answers, so its engine profiles
    # too or, when A's figure is in etcd by then (a loaded host), reuses it.
    assert ep["engines"]["a-e0"]["kv_source"] == "profiled"
    assert ep["engines"]["b-e0"]["kv_source"] in ("profiled", "reused")
    # Requests enter through either node's HTTP and run on that node's rank; the MoE layers
    # of both go through the one group spanning the namespaces.
    assert _text(a) == reference
    assert _text(b) == reference
    assert "expert parallel: epoch" in a.cli("status").stdout and "placement: a 1/2" in a.cli("status").stdout


@pytest.mark.slow  # make test-all (the default suite stays within CI's time; see README)
def test_scale_to_3_places_the_third_engine_then_back_to_2(nodes, reference):
    a, b = nodes
    r = b.cli("scale", "to", "3", "--wait")  # any node writes the cluster's desired
    assert r.returncode == 0, r.stdout + r.stderr + a.logs()
    assert "done: 3 engines serving" in r.stdout, r.stdout
    s = a.wait(lambda s: _group(s, {"a": 2, "b": 1}), 120, "3 ranks, the third on the oldest node")
    assert s["ep"]["desired"] == 3
    assert [e["kv_source"] for e in s["engines"]] == ["profiled", "reused"]  # no profile for the new one
    assert _text(a) == reference and _text(b) == reference
    r = a.cli("scale", "to", "2", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    s = b.wait(lambda s: _group(s, {"a": 1, "b": 1}), 120, "back to 2 ranks, one per node")
    assert _text(a) == reference and _text(b) == reference
    assert len(a.status()["engines"]) == 1


def _index(d: NodeDaemon, check, what: str) -> dict:
    """Node ``d``'s frontend's routing figures for its engine 0, once ``check`` holds (they
    come with the frontend's liveness beats: up to a beat old)."""
    return d.wait(lambda s: check(((s.get("routing") or {}).get("engines") or {}).get("0") or {}), 30, what)


def test_sigkilled_rank_on_node_b_is_reformed_around_and_rejoins(nodes, reference):
    """Also node B's prefix index of its rank: filled by a long prompt, dropped with the
    killed process, filled again by the restarted one; the prompt's text the same."""
    a, b = nodes
    long_prompt = dict(PROMPT, prompt="def main(argv):\n" + "    total = compute(argv, total)\n" * 24, max_tokens=4)
    long_text = _text(b, long_prompt)
    assert _text(b, long_prompt) == long_text
    _index(b, lambda e: e.get("num_cached_blocks", 0) >= 4 and e.get("routed_cached_tokens", 0) >= 64,
           "node b's index holding the long prompt, and a routed hit on it")
    epoch0 = a.status()["ep"]["epoch"]
    engine = b.status()["engines"][0]
    os.kill(engine["pid"], signal.SIGKILL)
    a.wait(lambda s: (s.get("ep") or {}).get("epoch", 0) > epoch0 and s["ep"]["ranks"] == ["a-e0"],
           60, "a group re-formed without b's rank")
    s = b.wait(lambda s: _group(s, {"a": 1, "b": 1}) and s["ep"]["epoch"] > epoch0 + 1, 180, "b's rank rejoined")
    assert s["engines"][0]["restarts"] == engine["restarts"] + 1 and s["engines"][0]["pid"] != engine["pid"]
    assert s["engines"][0]["kv_source"] == "reused"
    _index(b, lambda e: e.get("num_cached_blocks") == 0 and e.get("num_routed_while_down") == 0,
           "node b's index of its restarted rank empty")
    assert _text(b) == reference and _text(a) == reference
    assert _text(b, long_prompt) == long_text
    _index(b, lambda e: e.get("num_cached_blocks", 0) >= 4, "node b's index filled again by the new process")


@pytest.mark.slow  # make test-all (the default suite stays within CI's time; see README)
def test_a_node_left_without_engines_is_not_ready(nodes, reference):
    """No replay across nodes: a node whose last engine leaves answers /ready 503, so a load
    balancer stops sending it requests; it is ready again once it has an engine."""
    a, b = nodes
    r = a.cli("scale", "to", "1", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    b.wait(lambda s: _group(s, {"a": 1, "b": 0}) and not s["engines"], 120, "b without engines")
    code, body = b.ready()
    assert code == 503 and body["num_healthy_engines"] == 0, body
    assert a.ready()[0] == 200 and _text(a) == reference
    r = b.cli("scale", "to", "2", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    b.wait(lambda s: _group(s, {"a": 1, "b": 1}), 120, "b serving again")
    assert b.ready()[0] == 200 and _text(b) == reference
