"""`planaria status`'s text view: the expert-parallel epoch, ranks and operations."""

from __future__ import annotations

from planaria.daemon.commands import status


def engine(engine_id, state="running", **kw):
    return {"engine_id": engine_id, "rank": engine_id, "state": state, "pid": 100 + engine_id,
            "uptime_s": 61.0, "restarts": 0, "reason": "", "num_running": 1, "num_waiting": 0,
            "kv_usage": 0.25, "kv_cache_bytes": 16 << 20, "kv_source": "profiled", **kw}


def data(ep=None, *engines):
    return {"status": "2/2 engines up", "http": "127.0.0.1:8000", "engines": list(engines),
            "frontend": {"state": "running", "pid": 9, "uptime_s": 62.0, "restarts": 0},
            "scale": None, "ep": ep}


EP = {"epoch": 7, "world_size": 2, "ranks": ["n-e0", "n-e1"], "leader": True, "op": None, "last_op": None,
      "engines": {}}


def test_replica_mode_has_no_ep_lines_or_columns():
    text = status.render(data(None, engine(0)))
    assert "expert parallel" not in text and "EPOCH" not in text


def test_ep_view_shows_epoch_ranks_and_active_op():
    op = {"op_id": "op-1", "phase": "switching", "target": 3, "progress": "epoch 8: ScaleUp to 3 ranks",
          "error": ""}
    text = status.render(data({**EP, "op": op}, engine(0, epoch=7, ep_state="serving", transport="shm"),
                              engine(1, epoch=7, ep_state="unhealthy")))
    lines = text.splitlines()
    assert "expert parallel: epoch 7, 2 rank(s): n-e0, n-e1; this node leads" in lines
    assert "op op-1: switching, to 3 engine(s) (epoch 8: ScaleUp to 3 ranks)" in lines
    header = next(line for line in lines if line.startswith("ENGINE"))
    assert header.split()[-5:] == ["EPOCH", "EP", "STATE", "EP", "LINK"]
    assert lines[-2].split()[-3:] == ["7", "serving", "shm"]
    assert lines[-1].split()[-3:] == ["7", "unhealthy", "-"]


def test_ep_view_shows_a_failed_op_with_its_reason_and_etcd_outage():
    last = {"op_id": "op-2", "phase": "failed", "target": 3, "progress": "aborted epoch 8",
            "error": "epoch 8: not served by all its ranks within 30 s"}
    text = status.render(data({**EP, "last_op": last, "leader": False}, engine(0, epoch=9, ep_state="serving")))
    assert "op: none in progress" in text
    assert "last op op-2: failed, to 3 engine(s) (aborted epoch 8): epoch 8: not served" in text
    assert "this node leads" not in text
    text = status.render(data({"error": "etcd unreachable: down"}, engine(0)))
    assert "expert parallel: etcd unreachable: down" in text


def test_standby_line():
    sb = {"size": 1, "num_taken": 2, "next_start_in_s": 7.2,
          "processes": [{"pid": 41, "state": "ready", "uptime_s": 75.0}]}
    text = status.render({**data(EP, engine(0)), "standby": sb})
    assert "standby: pid 41 ready (1m15s); 2 taken; next starts in 7s" in text.splitlines()


def test_embedded_etcd_line_with_and_without_an_outage():
    etcd = {"state": "running", "pid": 4242, "endpoint": "127.0.0.1:2379", "restarts": 1, "uptime_s": 5.0,
            "last_exit": "killed by SIGKILL", "restart_in_s": None, "reason": ""}
    lines = status.render(data({**EP, "etcd": etcd}, engine(0))).splitlines()
    assert ("etcd (embedded): running pid 4242 on 127.0.0.1:2379, uptime 0m05s, restarts 1 "
            "(last exit: killed by SIGKILL)") in lines
    down = {**etcd, "state": "backoff", "pid": None, "uptime_s": None, "restart_in_s": 0.4}
    lines = status.render(data({"error": "etcd unreachable: down", "etcd": down}, engine(0))).splitlines()
    assert "expert parallel: etcd unreachable: down" in lines
    assert ("etcd (embedded): backoff on 127.0.0.1:2379, restarts 1 (last exit: killed by SIGKILL); "
            "restarting in 0.4s") in lines
    assert not any(line.startswith("etcd (embedded)") for line in status.render(data(EP, engine(0))).splitlines())


def test_frontend_line_shows_its_event_loop_liveness_and_last_kill_reason():
    fe = {"state": "running", "pid": 9, "uptime_s": 62.0, "restarts": 1,
          "reason": "frontend hung: event loop did not answer for 10.0 s (limit 10 s)",
          "last_answer_age_s": 0.43, "num_answers": 12, "loop_lag_s": 0.001, "hang_timeout_s": 10.0}
    lines = status.render({**data(None, engine(0)), "frontend": fe}).splitlines()
    assert ("frontend: running pid 9 on 127.0.0.1:8000, uptime 1m02s, restarts 1, "
            "event loop answered 0.4s ago (limit 10s)") in lines
    assert "frontend last exit: frontend hung: event loop did not answer for 10.0 s (limit 10 s)" in lines
    starting = {**fe, "state": "starting", "reason": "", "last_answer_age_s": None}
    lines = status.render({**data(None, engine(0)), "frontend": starting}).splitlines()
    assert lines[1].endswith("restarts 1, event loop not answered yet")
    assert not any(line.startswith("frontend last exit") for line in lines)
    off = {**fe, "hang_timeout_s": 0.0}
    assert status.render({**data(None, engine(0)), "frontend": off}).splitlines()[1].endswith(
        "event loop answered 0.4s ago")
