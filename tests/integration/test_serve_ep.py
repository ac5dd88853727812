"""`planaria serve --parallel ep` for real: an embedded etcd, two EP ranks of tiny-moe
under the supervisor, scaled with the admin CLI; a SIGKILLed rank is re-formed around
and rejoins after its restart. Greedy outputs stay those of the single-engine run."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from planaria.elastic.ep_proc import EP_FAULT_ENV
from planaria.engine.envs import FAULT_INJECTION
from tests.integration.test_supervisor import Daemon, _stop_tree

pytestmark = pytest.mark.timeout(400)
PROMPT = {"model": "tiny-moe", "prompt": "def main(argv):", "max_tokens": 12, "temperature": 0.0,
          "ignore_eos": True}


@pytest.fixture(scope="module")
def daemon(tiny_moe, tmp_path_factory):
    # a leaving rank's etcd watch runs late (1 s): its peers vote for the epoch that drops it
    # before it has seen that epoch, every time (CI saw it 1 run in many)
    d = Daemon(tiny_moe, tmp_path_factory.mktemp("serve-ep"), extra_args=("--parallel", "ep"),
               env={FAULT_INJECTION: "1", EP_FAULT_ENV: "late_epoch_watch"})
    try:
        d.wait(lambda s: s["num_up"] == 2 and (s.get("ep") or {}).get("world_size") == 2
               and all(e["state"] == "serving" for e in s["ep"]["engines"].values()), 180, "EP group of 2")
        yield d
    finally:
        _stop_tree(d.proc)


@pytest.fixture(scope="module")
def reference(tiny_moe):
    from planaria.engine import LLM, SamplingParams

    llm = LLM(tiny_moe, kv_cache_bytes=16 * 2**20, max_model_len=256)
    return llm.generate([PROMPT["prompt"]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].text


def _text(d: Daemon) -> str:
    status, body = d.http("/v1/completions", PROMPT)
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


def _group(s: dict, n: int) -> bool:
    ep = s.get("ep") or {}
    return (ep.get("world_size") == n and ep.get("op") is None and s["num_up"] == n
            and all(ep["engines"].get(r, {}).get("state") == "serving" for r in ep["ranks"]))


def test_ep_group_serves_single_engine_output(daemon, reference):
    assert _text(daemon) == reference
    s = daemon.status()
    assert s["parallel"] == "ep" and [e["rank"] for e in s["engines"]] == [0, 1]
    # The shared daemon config passes kv_cache_bytes explicitly ("given"); the profiled
    # path is covered by tests/integration/test_ep_scaling.py.
    assert {e["kv_source"] for e in s["engines"]} == {"given"}
    # both ranks on this node: the group's MoE exchange goes through shared memory
    assert [e["transport"] for e in s["engines"]] == ["shm", "shm"]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"planaria-ep-{os.getuid()}-")]


def _standby_ready(s: dict) -> bool:
    return bool(s["standby"]["processes"]) and s["standby"]["processes"][0]["state"] == "ready"


def test_scale_up_takes_the_warm_standby_reuses_kv_then_scale_down(daemon, reference):
    s = daemon.wait(_standby_ready, 120, "a warm standby")
    standby_pid = s["standby"]["processes"][0]["pid"]
    assert "standby: pid" in daemon.cli("status").stdout
    r = daemon.cli("scale", "to", "3", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    s = daemon.wait(lambda s: _group(s, 3), 180, "EP group of 3")
    assert [e["kv_source"] for e in s["engines"]] == ["given", "given", "reused"]
    assert s["engines"][2]["pid"] == standby_pid  # the standby process went on as the new rank
    assert s["standby"]["num_taken"] == 1
    assert "warm standby pid" in (daemon.state / "logs" / "engine-2.log").read_text()
    assert _text(daemon) == reference
    r = daemon.cli("scale", "down", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    daemon.wait(lambda s: _group(s, 2), 120, "EP group of 2 again")
    assert _text(daemon) == reference


def test_back_to_back_and_overlapping_scale_cycles_under_load_never_fail(daemon, tiny_moe):
    """`scale to 3 --wait` / `scale to 2 --wait`, back to back, under a streaming load: every
    operation succeeds, quickly. The scale-down used to fail after 30 s: the supervisor read
    the newest epoch (which already left the departing rank out), stopped the rank while its
    peers were inside a collective with it, and the peers' broken group forgot the epoch
    they had already taken, waiting for the leader's abort. Then an overlapping request:
    the later one supersedes the earlier, which ends cancelled (not failed)."""
    from bench.closed_loop import ClosedLoopLoad, mismatches, offline_reference
    from bench.streaming_load import request_bodies

    bodies = request_bodies(6, (16, 32), seed=5)
    reference = offline_reference(tiny_moe, bodies, kv_cache_bytes=16 * 2**20, max_model_len=256)
    daemon.wait(lambda s: _group(s, 2), 120, "EP group of 2")
    load = ClosedLoopLoad(daemon.base, bodies, num_streams=3).start()
    try:
        load.wait_done(3)
        for target in (3, 2, 3, 2):
            t0 = time.monotonic()
            r = daemon.cli("scale", "to", str(target), "--wait", "--wait-timeout-s", "60")
            took = time.monotonic() - t0
            assert r.returncode == 0, r.stdout + r.stderr + daemon.logs()
            assert took < 30, (target, took, r.stdout)
        first = daemon.cli("scale", "to", "3")  # not waited for: superseded by the next
        assert first.returncode == 0, first.stdout + first.stderr
        r = daemon.cli("scale", "to", "2", "--wait", "--wait-timeout-s", "60")
        assert r.returncode == 0, r.stdout + r.stderr + daemon.logs()
        daemon.wait(lambda s: _group(s, 2), 60, "EP group of 2")
        load.wait_done(load.num_done + 3)
    finally:
        records = load.stop()
    failed = [rec.result for rec in records if rec.result.get("error") or rec.result.get("status") != 200]
    assert not failed, failed[:3]
    assert not mismatches(records, reference), mismatches(records, reference)[:3]
    ops = daemon.status()["ep"]["ops"]
    assert not [o for o in ops.values() if o["phase"] == "failed"], ops
    assert any(o["phase"] == "cancelled" and "superseded" in (o["error"] or "") for o in ops.values()), ops


def test_a_restarted_rank_leaves_at_an_epoch_boundary_and_its_peer_never_fails(daemon):
    """`planaria restart` of an idle EP rank: it drains by leaving at an epoch boundary (its
    record says DRAINING, the leader re-forms without it, the group switches), so its peer
    is never inside a collective with a rank that is gone. It used to exit at once (no
    work, drained), and the peer's group failed under it (failed_epoch, UNHEALTHY). Its
    watch runs late here (the fixture's fault): the group agrees on the epoch that drops it
    before it has seen it; it reads the epoch then and leaves at that boundary (it used to
    drop out as a failed group, 1 CI run in many)."""
    s = daemon.wait(lambda s: _group(s, 2), 120, "EP group of 2")
    survivor = s["ep"]["ranks"][0]
    failed_before = s["ep"]["engines"][survivor]["failed_epoch"]
    pid = s["engines"][1]["pid"]
    r = daemon.cli("restart", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    s = daemon.wait(lambda s: _group(s, 2) and s["engines"][1]["pid"] != pid, 120, "the rank back")
    assert s["ep"]["engines"][survivor]["failed_epoch"] == failed_before, s["ep"]["engines"]
    log = (daemon.state / "logs" / "engine-1.log").read_text()
    assert "left the cluster: scaled down: not a rank of epoch" in log, log[-3000:]


def test_bad_scale_changes_nothing(daemon):
    r = daemon.cli("scale", "to", "0")
    assert r.returncode != 0 and "between 1" in (r.stdout + r.stderr)
    assert _group(daemon.status(), 2)


def test_sigkilled_rank_is_reformed_around_and_rejoins(daemon, reference):
    s = daemon.status()
    epoch0, restarts0 = s["ep"]["epoch"], s["engines"][1]["restarts"]
    os.kill(s["engines"][1]["pid"], signal.SIGKILL)
    s = daemon.wait(lambda s: (s.get("ep") or {}).get("epoch", 0) > epoch0
                    and s["ep"]["world_size"] == 1, 60, "a re-formed group of 1")
    s = daemon.wait(lambda s: _group(s, 2) and s["ep"]["epoch"] > epoch0 + 1, 180, "rejoined group of 2")
    if s["engines"][1]["restarts"] != restarts0 + 1:
        print(daemon.logs())  # whole, in the report's captured stdout (an assert message is cut)
    assert s["engines"][1]["restarts"] == restarts0 + 1, s["engines"][1]
    # The restarted rank took the group's KV figure instead of profiling again.
    assert s["engines"][1]["kv_source"] == "reused"
    assert s["ep"]["engines"][s["ep"]["ranks"][1]]["kv_source"] == "reused"
    assert _text(daemon) == reference


def test_hung_rank_under_load_is_killed_reformed_around_and_rejoins(daemon, tiny_moe):
    """SIGSTOP of a rank mid-load: the survivor's collectives stall, and it is not killed
    for it (it waits on a peer); the supervisor kills the silent rank; the survivor goes
    UNHEALTHY with its requests kept (failed_epoch in its record, same pid), the leader
    re-forms without the lost rank, which restarts (reusing the KV figure) and rejoins.
    Every request of a closed-loop load completes with the fault-free text."""
    from bench.closed_loop import ClosedLoopLoad, metric, mismatches, offline_reference
    from bench.streaming_load import request_bodies

    bodies = request_bodies(8, (32, 64), seed=11)
    reference = offline_reference(tiny_moe, bodies, kv_cache_bytes=16 * 2**20, max_model_len=256)
    s = daemon.wait(lambda s: _group(s, 2), 60, "EP group of 2")
    epoch0, ranks0 = s["ep"]["epoch"], s["ep"]["ranks"]
    survivor, hung = s["engines"]
    restarts0 = hung["restarts"]
    load = ClosedLoopLoad(daemon.base, bodies, num_streams=4).start()
    try:
        load.wait_done(4)
        replays = metric(daemon.base, "planaria_request_replays_total")
        stopped_at = time.time()
        os.kill(hung["pid"], signal.SIGSTOP)
        # a group of 1 without the hung rank; a warm standby may rejoin it within a
        # fraction of a second (then the status polls see the group of 2 two epochs on)
        daemon.wait(lambda s: ((s.get("ep") or {}).get("world_size") == 1 and s["ep"]["epoch"] > epoch0)
                    or (_group(s, 2) and s["ep"]["epoch"] > epoch0 + 1), 60, "a group of 1 without the hung rank")
        s = daemon.wait(lambda s: _group(s, 2) and s["ep"]["epoch"] > epoch0 + 1, 180, "the rank rejoined")
        load.wait_done(load.num_done + 4)
    finally:
        records = load.stop()
    assert not mismatches(records, reference), mismatches(records, reference)[:3]
    assert load.in_flight_across(stopped_at), "no request was in flight when the rank hung"
    assert metric(daemon.base, "planaria_request_replays_total") > replays  # its requests moved
    now_survivor, now_hung = s["engines"]
    assert now_survivor["pid"] == survivor["pid"] and now_survivor["restarts"] == survivor["restarts"]
    assert now_hung["restarts"] == restarts0 + 1 and now_hung["pid"] != hung["pid"]
    assert "stopped (SIGSTOP)" in now_hung["reason"], \
        now_hung["reason"]
    assert now_hung["kv_source"] == "reused"
    rec = s["ep"]["engines"][ranks0[0]]  # the survivor went UNHEALTHY at the lost epoch, then re-formed
    assert rec["failed_epoch"] >= epoch0 and rec["state"] == "serving"


@pytest.mark.slow  # make test-all (the default suite stays within CI's time; see README)
def test_serve_with_a_secured_etcd_cluster(tiny_moe, tmp_path, reference):
    """--etcd-endpoints of an etcd with TLS and auth: the supervisor and its EP engine process
    reach it with the given certificates, user and password file (the engines through their
    environment); the password is on no command line."""
    import psutil

    from tests.elastic.conftest import _require_etcd
    from tests.elastic.pki import make_pki, secure_etcd

    _require_etcd()
    pki = make_pki(tmp_path / "pki")
    if pki is None:
        pytest.skip("no openssl command")
    password = "serve-pw-123"
    etcd, password_file = secure_etcd(tmp_path, pki, "planaria", password)
    d = None
    try:
        d = Daemon(tiny_moe, tmp_path / "serve", extra_args=(
            "--parallel", "ep", "--engines", "1", "--etcd-endpoints", etcd.endpoint, "--etcd-ca-cert", pki.ca,
            "--etcd-cert", pki.client_cert, "--etcd-key", pki.client_key, "--etcd-user", "planaria",
            "--etcd-password-file", password_file))
        s = d.wait(lambda s: _group(s, 1), 180, "an EP group of 1 over the secured etcd")
        assert s["ep"]["leader"] and s["ep"]["engines"][s["ep"]["ranks"][0]]["state"] == "serving"
        assert _text(d) == reference
        for p in [psutil.Process(d.proc.pid), *psutil.Process(d.proc.pid).children(recursive=True)]:
            assert password not in " ".join(p.cmdline())
    finally:
        if d is not None:
            _stop_tree(d.proc)
        etcd.stop()
