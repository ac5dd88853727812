"""`planaria scale --wait`'s progress display: status replies in, lines out."""

from __future__ import annotations

from planaria.daemon.commands import scale


def engine(engine_id, state, **kw):
    return {"engine_id": engine_id, "rank": engine_id, "state": state, "pid": 100 + engine_id,
            "reason": "", "kv_source": None, "kv_cache_bytes": None, **kw}


def status(*engines, scale_op=None, ep=None):
    return {"engines": list(engines), "num_engines": len(engines),
            "num_up": sum(e["state"] == "running" for e in engines), "scale": scale_op, "ep": ep}


RUNNING = dict(kv_source="given", kv_cache_bytes=16 << 20)
OP = {"op_id": 1, "target": 3, "adding": [2], "removing": []}


def test_scale_up_shows_each_engine_state_once_as_it_changes():
    steps = [
        status(engine(0, "running", **RUNNING), engine(1, "running", **RUNNING),
               engine(2, "starting"), scale_op=OP),
        status(engine(0, "running", **RUNNING), engine(1, "running", **RUNNING),
               engine(2, "starting"), scale_op=OP),  # nothing new: no lines
        status(engine(0, "running", **RUNNING), engine(1, "running", **RUNNING),
               engine(2, "running", kv_source="reused", kv_cache_bytes=16 << 20)),
    ]
    views, lines = None, []
    for st in steps:
        new = scale.progress_view(st)
        lines.append(scale.render_changes(views, new))
        views = new
    assert lines == [
        ["engine 0: running, kv given 16.0MiB", "engine 1: running, kv given 16.0MiB",
         "engine 2: starting"],
        [],
        ["engine 2: running, kv reused 16.0MiB"],
    ]
    assert not scale.finished(steps[0], 1) and scale.finished(steps[2], 1)
    assert scale.render_final(steps[2], 3, 12.34) == ("done: 3 engines serving (12.3s)", True)


def test_scale_down_reports_engines_that_went_away():
    before = scale.progress_view(status(engine(0, "running"), engine(1, "stopping"), scale_op=OP))
    after = scale.progress_view(status(engine(0, "running")))
    assert scale.render_changes(before, after) == ["engine 1: gone"]


def test_ep_mode_shows_the_record_state_and_the_op_phase():
    ep = {"op": {"op_id": "op-7", "target": 3, "phase": "launching", "progress": "1/3 engines loaded"}}
    st = status(engine(0, "running", ep_state="serving", **RUNNING),
                engine(2, "starting", ep_state="loading", rank=None), ep=ep)
    view = scale.progress_view(st)
    assert view == {"engine 0": "running (ep serving, rank 0), kv given 16.0MiB",
                    "engine 2": "starting (ep loading)",
                    "op": "ep op op-7 to 3: launching (1/3 engines loaded)"}
    assert not scale.finished(st, 1)  # the local op is over, the EP op is not
    ep2 = {"op": {**ep["op"], "phase": "switching", "progress": ""}}
    st2 = status(engine(0, "running", ep_state="paused", **RUNNING),
                 engine(2, "running", ep_state="ready", **RUNNING), ep=ep2)
    assert scale.render_changes(view, scale.progress_view(st2)) == [
        "engine 0: running (ep paused, rank 0), kv given 16.0MiB",
        "engine 2: running (ep ready, rank 2), kv given 16.0MiB",
        "ep op op-7 to 3: switching"]
    assert scale.finished(status(engine(0, "running"), ep={"op": None}), 1)


def test_final_line_names_what_did_not_make_it():
    st = status(engine(0, "running"), engine(1, "failed", reason="exit code 1"),
                engine(2, "backoff", reason="killed by SIGKILL"))
    line, ok = scale.render_final(st, 3, 61.0)
    assert not ok
    assert line == ("scale to 3 ended after 61.0s with 1/3 engines up: engine 1 failed: exit code 1; "
                    "engine 2 backoff: killed by SIGKILL")
    failed_ep = status(engine(0, "running"), ep={"op": {"op_id": "x", "target": 2,
                                                         "phase": "failed", "progress": ""}})
    assert scale.render_final(failed_ep, 2, 3.0) == (
        "scale to 2 failed after 3.0s (ep op x); 1/1 engines up", False)
    # A finished op is the status's last_op, no longer its op: named with its reason.
    aborted = status(engine(0, "running"), ep={"op": None, "last_op": {
        "op_id": "op-9", "target": 3, "phase": "failed", "progress": "aborted epoch 4",
        "error": "rank 2 never served epoch 4"}})
    assert scale.render_final(aborted, 3, 5.0, "op-9") == (
        "scale to 3 failed after 5.0s (ep op op-9: rank 2 never served epoch 4); 1/1 engines up", False)
    assert "failed" not in scale.render_final(aborted, 3, 5.0, "op-8")[0]  # another op's outcome


def test_started_line_says_what_began():
    assert scale.render_started({"engines": 2, "target": 4, "op_id": 3, "adding": [2, 3],
                                 "removing": []}) == \
        "scaling 2 -> 4 engines (op 3): starting engines 2, 3"
    assert scale.render_started({"engines": 3, "target": 2, "op_id": 4, "adding": [],
                                 "removing": [2]}) == \
        "scaling 3 -> 2 engines (op 4): draining engine 2"


def test_a_superseded_op_ends_its_wait_and_says_by_whom():
    """`scale to 3 --wait` while someone else's `scale to 2` lands: the wait for op-1 ends
    when op-1 is cancelled (not when the newer op-2 ends), and names op-2."""
    superseded = {"op_id": "op-1", "target": 3, "phase": "cancelled", "progress": "",
                  "error": "superseded by op-2 (scale to 2)"}
    newer = {"op_id": "op-2", "target": 2, "phase": "launching", "progress": ""}
    st = status(engine(0, "running"), ep={"op": newer, "last_op": superseded,
                                          "ops": {"op-1": superseded, "op-2": newer}})
    assert scale.finished(st, "op-1") and not scale.finished(st, "op-2")
    assert scale.render_final(st, 3, 2.0, "op-1") == (
        "scale to 3 cancelled after 2.0s (ep op op-1: superseded by op-2 (scale to 2)); 1/1 engines up", False)
    # op-2 finished too before the wait looked again: op-1 is found among the recent ops
    done = {**newer, "phase": "done"}
    later = status(engine(0, "running"), ep={"op": None, "last_op": done, "ops": {"op-1": superseded, "op-2": done}})
    assert scale.finished(later, "op-1") and "superseded by op-2" in scale.render_final(later, 3, 4.0, "op-1")[0]
