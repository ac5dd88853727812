"""Supervisor logic with a fake spawner, a fake clock and fake notifier/reporter."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from planaria.daemon import config as config_mod
from planaria.common.envelope import ErrorCode
from planaria.common.errors import AdminError
from planaria.daemon.children import describe_exit
from planaria.daemon.slot import Incarnation
from planaria.daemon.supervisor import EXIT_FAILURE, SlotState, Supervisor
from planaria.engine.heartbeat import Heartbeat


class FakeChild:
    def __init__(self, spec, pid):
        self.spec, self.pid = spec, pid
        self.signals: list[int] = []
        self.returncode = None

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.signals.append(sig)
        return self.returncode is None


class FakeSpawner:
    def __init__(self):
        self.children: list[FakeChild] = []
        self._pid = 1000

    def spawn(self, spec):
        self._pid += 1
        child = FakeChild(spec, self._pid)
        self.children.append(child)
        return child

    def live(self, key):
        return [c for c in self.children if c.spec.key == key and c.returncode is None]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class FakeNotifier:
    def __init__(self):
        self.lines: list[str] = []

    def ready(self, status=None):
        self.lines.append(f"READY=1 {status}")

    def status(self, text):
        self.lines.append(f"STATUS={text}")

    def stopping(self, status=None):
        self.lines.append("STOPPING=1")

    def reloading(self, status=None):
        self.lines.append("RELOADING=1")


def make(num_engines=2, stopped_pids=None, **flags):
    """``stopped_pids``: the pids the process-state probe finds stopped (SIGSTOP); the
    stopped watch (and its 0.2 s poll) is on only where a test gives it a timeout."""
    flags.setdefault("stopped_timeout_s", 0.0)
    cfg = config_mod.build({"model": "/m", "num_engines": num_engines, "state_dir": "/s",
                            "restart_backoff_s": 1.0, "hang_timeout_s": 5.0,
                            "stop_timeout_s": 10.0, "stable_s": 0.0, **flags}, environ={})
    spawner, clock, notifier, deaths = FakeSpawner(), Clock(), FakeNotifier(), []
    stopped = stopped_pids if stopped_pids is not None else set()
    sup = Supervisor(cfg, spawner, clock, notifier=notifier,
                     report_dead=lambda e, pid, reason, suspects=(): deaths.append((e, pid, reason)),
                     is_job_stopped=lambda pid: pid in stopped)
    sup.start()
    return sup, spawner, clock, notifier, deaths


def beat(sup, engine_id, step=0, has_work=False, state="running", kv=1 << 20, source="profiled"):
    child = sup.engines[engine_id].child
    sup.on_heartbeat(Heartbeat(engine_index=engine_id, pid=child.pid, step_counter=step,
                               has_work=has_work, state=state, kv_cache_bytes=kv,
                               kv_source=source))


def die(sup, child, code=-9):
    child.returncode = code
    sup.on_exit(child)


def engine_child(spawner, engine_id):
    return spawner.live(("engine", engine_id))[-1]


def test_start_spawns_frontend_then_engines_and_ready_on_first_serving_engine():
    sup, spawner, clock, notifier, _ = make()
    assert [c.spec.key for c in spawner.children] == [("frontend",), ("engine", 0), ("engine", 1)]
    assert spawner.children[1].spec.argv[1:3] == ["-m", "planaria.engine.proc"]
    assert not any(line.startswith("READY") for line in notifier.lines)
    beat(sup, 0)
    assert notifier.lines[-1] == "READY=1 1/2 engines up, 0 restarts, frontend running"
    beat(sup, 1)
    assert notifier.lines[-1] == "STATUS=2/2 engines up, 0 restarts, frontend running"


def test_engine_death_is_reported_first_then_restarted_with_backoff():
    sup, spawner, clock, _, deaths = make()
    beat(sup, 0)
    old = engine_child(spawner, 0)
    die(sup, old)
    assert deaths == [(0, old.pid, "killed by SIGKILL")]
    # the first failure waits backoff_initial_s (1 s)
    assert sup.engines[0].state is SlotState.BACKOFF
    assert sup.tick() == pytest.approx(clock.t + 1.0)
    clock.t += 1.0
    sup.tick()
    new = engine_child(spawner, 0)
    assert new is not old and sup.engines[0].state is SlotState.STARTING
    assert sup.policy.restarts(("engine", 0)) == 1
    # it dies again before it ever served: the backoff doubles
    die(sup, new, 1)
    assert sup.engines[0].due_at == pytest.approx(clock.t + 2.0)
    assert sup.status()["engines"][0]["reason"] == "exit code 1"


def test_an_engine_killed_after_serving_restarts_promptly_every_time():
    """Killed from outside after doing work (step counter > 0): the served delay each time,
    no doubling and no flap hold, however many times in the flap window (under the cap)."""
    sup, spawner, clock, _, _ = make(served_restart_delay_s=0.1)
    for _ in range(8):  # more than flap_max_exits (5) inside the 60 s window
        beat(sup, 0, step=3, has_work=True)
        die(sup, engine_child(spawner, 0))
        assert sup.engines[0].state is SlotState.BACKOFF and not sup.engines[0].held
        assert sup.engines[0].due_at == pytest.approx(clock.t + 0.1)
        clock.t += 0.1
        sup.tick()
        assert sup.engines[0].state is SlotState.STARTING
        clock.t += 2.0
    assert sup.policy.restarts(("engine", 0)) == 8


def test_the_last_engine_is_never_held_the_availability_floor():
    """A start-up crash loop on both engines: the first to flap is held (the other one is
    still coming back), the second is the node's last and comes back at the backoff cap
    (60 s) instead of the 300 s hold; status says why."""
    sup, spawner, clock, _, _ = make(restart_backoff_s=0.0, flap_max_exits=3)
    def crash(engine_id):
        die(sup, engine_child(spawner, engine_id), 1)
        sup.tick()
    for _ in range(3):
        crash(0)
    assert sup.engines[0].held and sup.engines[0].due_at == pytest.approx(clock.t + 300.0)
    for _ in range(3):
        crash(1)
    e1 = sup.engines[1]
    assert not e1.held and e1.state is SlotState.BACKOFF and e1.due_at == pytest.approx(clock.t + 60.0)
    assert "availability floor" in sup.status()["engines"][1]["reason"]
    clock.t += 60.0
    sup.tick()
    assert e1.state is SlotState.STARTING and sup.engines[0].held


def test_a_held_engine_is_brought_back_when_the_other_one_is_held_too():
    """Engine 0 held while engine 1 served; engine 1 then flaps too, at the backoff cap:
    one of them always has a restart due within the cap."""
    sup, spawner, clock, _, _ = make(restart_backoff_s=0.0, flap_max_exits=2, restart_backoff_max_s=30.0)
    for _ in range(2):
        die(sup, engine_child(spawner, 0), 1)
        sup.tick()
    assert sup.engines[0].held
    die(sup, engine_child(spawner, 1), 1)
    sup.tick()
    die(sup, engine_child(spawner, 1), 1)  # flaps: would be held 300 s
    due = [s.due_at - clock.t for s in sup.engines.values() if s.state is SlotState.BACKOFF]
    assert min(due) <= 30.0


def test_a_held_engine_comes_back_when_the_other_one_gives_up():
    """Engine 0 held (engine 1 was serving); engine 1 then reaches its retry limit and is
    given up: engine 0 is the node's last and is decided again, back at the backoff cap."""
    sup, spawner, clock, _, _ = make(restart_backoff_s=0.0, flap_max_exits=2, retry_limit=3)
    for _ in range(2):
        die(sup, engine_child(spawner, 0), 1)
        sup.tick()
    assert sup.engines[0].held
    for _ in range(4):  # start-up failures (never a step); the floor restarts it at the cap
        if sup.engines[1].child is None:
            clock.t = sup.engines[1].due_at
            sup.tick()
        die(sup, engine_child(spawner, 1), 1)
    assert sup.engines[1].state is SlotState.FAILED
    e0 = sup.engines[0]  # its exit was over 60 s ago by now: restarted at once
    assert not e0.held and e0.state is SlotState.STARTING


def test_is_stopped_reads_a_real_stopped_process():
    import subprocess

    from planaria.daemon.supervisor import _is_stopped

    p = subprocess.Popen(["sleep", "30"])
    try:
        assert not _is_stopped(p.pid)
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not _is_stopped(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _is_stopped(p.pid)
    finally:
        p.kill()
        p.wait()
    assert not _is_stopped(p.pid) and not _is_stopped(None)


@pytest.mark.parametrize("how,stopped,expected", [
    ("sigkill from outside", False, "external"),
    ("crash: exit code 1", False, "fault"),
    ("crash: SIGSEGV", False, "fault"),
    ("watchdog kill of a running hung engine", False, "fault"),
    ("watchdog kill of a stopped engine", True, "external"),
])
def test_the_cause_of_death_follows_the_reap(monkeypatch, how, stopped, expected):
    """After the reap the supervisor tells the frontend what ended the engine, for the
    poison quarantine: only faults count there."""
    import planaria.daemon.supervisor as sup_mod

    monkeypatch.setattr(sup_mod, "_is_stopped", lambda pid: stopped)
    cfg = config_mod.build({"model": "/m", "num_engines": 2, "state_dir": "/s", "hang_timeout_s": 5.0},
                           environ={})
    spawner, clock, causes = FakeSpawner(), Clock(), []
    sup = Supervisor(cfg, spawner, clock, report_dead=lambda *a, **kw: None,
                     report_cause=lambda e, pid, reason, cause, suspects=(): causes.append((e, pid, cause)))
    sup.start()
    child = engine_child(spawner, 0)
    code = {"sigkill from outside": -9, "crash: exit code 1": 1, "crash: SIGSEGV": -11}.get(how, -9)
    if how.startswith("watchdog"):
        beat(sup, 0, step=1, has_work=True)
        clock.t += 5.1
        sup.tick()
        assert child.signals == [signal.SIGKILL]
    die(sup, child, code)
    assert causes == [(0, child.pid, expected)]


def test_exit_sentinel_reports_the_death_once_before_the_reap():
    sup, spawner, _, _, deaths = make()
    child = engine_child(spawner, 0)
    watched: list = []
    child.watched_tids = []
    child.watch_threads = lambda tids: watched.extend(tids) or len(tids)
    sup.on_heartbeat(Heartbeat(engine_index=0, pid=child.pid, step_counter=0, has_work=False,
                               state="running", exit_sentinel_tids=[7, 8]))
    assert watched == [7, 8]
    sup.on_exiting(child)  # threads gone, memory not yet freed: report now
    assert deaths == [(0, child.pid, "the engine process is exiting (its threads ended)")]
    assert sup.engines[0].state is SlotState.RUNNING  # not reaped yet: no restart decided
    die(sup, child)
    assert len(deaths) == 1  # the reap does not report it twice
    assert sup.engines[0].state is SlotState.BACKOFF and sup.engines[0].current is None


def test_heartbeat_of_an_older_incarnation_is_ignored():
    sup, spawner, _, _, _ = make()
    old = engine_child(spawner, 0)
    die(sup, old)
    sup.on_heartbeat(Heartbeat(engine_index=0, pid=old.pid, step_counter=1, has_work=True,
                               state="running"))
    assert sup.engines[0].state is SlotState.BACKOFF and sup.engines[0].current is None
    assert 0 not in sup.hang.check(1e9)


def test_nothing_of_one_incarnation_shows_on_the_next():
    """Every per-run mark (its heartbeat, a watchdog kill and why, the early death report,
    a planned restart and its SIGKILL deadline) goes with the process: the next one starts
    clean, and its own death is reported with its own reason, not the old kill reason."""
    stopped: set[int] = set()
    sup, spawner, clock, _n, deaths = make(stopped_pids=stopped, stopped_timeout_s=0.5)
    beat(sup, 0, step=1, has_work=True)
    beat(sup, 1, step=1, has_work=True)
    first, e0 = sup.engines[0].current, engine_child(spawner, 0)
    stopped.add(e0.pid)
    sup.tick()
    clock.t += 0.6
    sup.tick()  # the watchdog kills it: kill_reason, killed_stopped
    sup.on_exiting(e0)  # reported dead early: death_reported
    sup.restart_engine(0)  # planned: after_exit, kill_at
    assert first.kill_reason.startswith("frozen: stopped (SIGSTOP)") and first.killed_stopped
    assert first.death_reported and first.heartbeat is not None
    assert first.after_exit.value == "restart" and first.kill_at is not None
    die(sup, e0)
    second = sup.engines[0].current
    assert second is not first and second.child is engine_child(spawner, 0) is not e0
    assert second.started_at == clock.t
    fresh = {f.name: f.default for f in dataclasses.fields(Incarnation)
             if f.name not in ("child", "started_at")}
    assert {name: getattr(second, name) for name in fresh} == fresh
    assert sup.status()["engines"][0]["step_counter"] is None  # no heartbeat of its own yet
    assert sup.tick() <= clock.t + 0.25  # no SIGKILL deadline inherited: only the polls
    assert signal.SIGKILL not in engine_child(spawner, 0).signals
    num_deaths = len(deaths)
    die(sup, engine_child(spawner, 0), 1)  # its own death, unplanned
    assert deaths[num_deaths:] == [(0, second.pid, "exit code 1")]
    assert sup.engines[0].reason == "exit code 1" and sup.engines[0].current is None
    assert sup.engines[0].state is SlotState.BACKOFF  # a failure, not the old planned restart


def test_a_frontend_hang_kill_reason_does_not_outlive_its_process():
    sup, spawner, clock, _n, _d = make(frontend_hang_timeout_s=2.0, handshake_timeout_s=3.0)
    old = spawner.live(("frontend",))[-1]
    clock.t += 3.1
    sup.tick()
    assert old.signals == [signal.SIGKILL]
    assert sup.frontend.current.kill_reason.startswith("frontend hung")
    die(sup, old)
    assert sup.frontend.reason.startswith("frontend hung") and sup.frontend.current is None
    clock.t = sup.frontend.due_at
    sup.tick()
    new = spawner.live(("frontend",))[-1]
    assert new is not old and sup.frontend.current.kill_reason == ""
    die(sup, new, -11)  # a crash of the new one is its own, not a hang
    assert sup.frontend.reason == describe_exit(-11)


def test_retry_limit_gives_up_and_all_failed_engines_stop_the_daemon():
    sup, spawner, clock, notifier, _ = make(num_engines=1, retry_limit=1)
    die(sup, engine_child(spawner, 0), 1)
    clock.t += 1
    sup.tick()
    die(sup, engine_child(spawner, 0), 1)
    assert sup.engines[0].state is SlotState.FAILED
    assert "retry limit 1" in sup.engines[0].reason
    assert sup.shutting_down and sup.exit_code == EXIT_FAILURE
    assert "STOPPING=1" in notifier.lines
    fe = spawner.live(("frontend",))[0]
    assert fe.signals == [signal.SIGTERM]
    die(sup, fe, 0)
    assert sup.done


def test_hung_engine_is_killed_reported_and_restarted():
    sup, spawner, clock, _, deaths = make()
    beat(sup, 0, step=1, has_work=True)
    beat(sup, 1, step=1, has_work=False)
    clock.t += 4.9
    beat(sup, 0, step=1, has_work=True)  # no progress, but not yet 5 s
    sup.tick()
    hung = engine_child(spawner, 0)
    assert hung.signals == []
    clock.t += 0.2
    sup.tick()
    assert hung.signals == [signal.SIGKILL]
    assert engine_child(spawner, 1).signals == []  # idle engines are never hung
    die(sup, hung)
    assert deaths[-1][0] == 0 and deaths[-1][2].startswith("hung: work queued")
    assert sup.engines[0].state is SlotState.BACKOFF
    clock.t += 1.0
    sup.tick()
    assert sup.engines[0].state is SlotState.STARTING


def test_silent_engine_is_killed_as_frozen_even_if_it_was_idle():
    sup, spawner, clock, _, deaths = make()  # hang 5 s, silence 10 s
    beat(sup, 0, step=1, has_work=False)
    beat(sup, 1, step=1, has_work=False)
    for _ in range(4):  # engine 1 keeps beating, idle; engine 0 went silent (SIGSTOP)
        clock.t += 2.4
        beat(sup, 1, step=1, has_work=False)
        sup.tick()
    frozen = engine_child(spawner, 0)
    assert frozen.signals == []
    clock.t += 0.5
    beat(sup, 1, step=1, has_work=False)
    sup.tick()
    assert frozen.signals == [signal.SIGKILL]
    assert engine_child(spawner, 1).signals == []
    die(sup, frozen)
    assert deaths[-1][0] == 0 and deaths[-1][2].startswith("frozen: no heartbeat for 10.")


def test_engine_refused_for_its_config_is_not_restarted_and_status_says_why():
    from planaria.engine.proc import EXIT_CONFIG_MISMATCH

    sup, spawner, clock, notifier, deaths = make()
    beat(sup, 0)
    beat(sup, 1)
    refused = engine_child(spawner, 1)
    die(sup, refused, EXIT_CONFIG_MISMATCH)
    assert deaths[-1][:2] == (1, refused.pid)
    assert sup.engines[1].state is SlotState.FAILED
    for _ in range(3):  # no restart, ever: no hot loop
        clock.t += 60
        sup.tick()
    assert spawner.live(("engine", 1)) == []
    assert not sup.shutting_down  # engine 0 still serves
    assert notifier.lines[-1].startswith("STATUS=1/2 engines up, 0 restarts, frontend running, "
                                         "engine 1 failed: configuration error")
    assert "config hash or protocol version mismatch" in sup.status()["engines"][1]["reason"]
    sup.restart_engine(1)  # the operator fixed it: start again on request
    assert sup.engines[1].state is SlotState.STARTING


def test_every_engine_refused_for_its_config_stops_the_daemon_with_exit_2():
    from planaria.daemon.supervisor import EXIT_CONFIG
    from planaria.engine.proc import EXIT_CONFIG_MISMATCH

    sup, spawner, clock, notifier, _ = make(num_engines=2)
    die(sup, engine_child(spawner, 0), EXIT_CONFIG_MISMATCH)
    assert not sup.shutting_down
    die(sup, engine_child(spawner, 1), EXIT_CONFIG_MISMATCH)
    assert sup.shutting_down and sup.exit_code == EXIT_CONFIG == 2
    # one refused and one crashing past its retry limit: an ordinary failure
    sup, spawner, clock, notifier, _ = make(num_engines=2, retry_limit=0)
    die(sup, engine_child(spawner, 0), EXIT_CONFIG_MISMATCH)
    die(sup, engine_child(spawner, 1), 1)
    assert sup.shutting_down and sup.exit_code == EXIT_FAILURE


def test_frontend_death_restarts_it_and_recycles_the_engines():
    sup, spawner, clock, _, deaths = make()
    beat(sup, 0)
    beat(sup, 1)
    clock.t += 1
    sup.tick()
    fe = spawner.live(("frontend",))[0]
    die(sup, fe, 1)
    assert sup.frontend.state is SlotState.BACKOFF
    clock.t += 1
    sup.tick()
    new_fe = spawner.live(("frontend",))[0]
    assert new_fe is not fe
    olds = [engine_child(spawner, i) for i in (0, 1)]
    assert all(c.signals == [signal.SIGKILL] for c in olds)
    for c in olds:
        die(sup, c)
    assert [engine_child(spawner, i) is not old for i, old in enumerate(olds)] == [True, True]
    assert sup.policy.num_failures(("engine", 0)) == 0  # not an engine failure
    assert sup.policy.restarts(("frontend",)) == 1


def test_frontend_in_backoff_keeps_engines_waiting():
    sup, spawner, clock, _, _ = make()
    die(sup, spawner.live(("frontend",))[0], 1)
    assert sup.frontend.state is SlotState.BACKOFF
    for i in (0, 1):
        c = engine_child(spawner, i)
        die(sup, c)
    assert {s.state for s in sup.engines.values()} == {SlotState.WAITING}
    clock.t = sup.frontend.due_at
    sup.tick()
    assert sup.frontend.state is SlotState.STARTING
    assert {s.state for s in sup.engines.values()} == {SlotState.STARTING}


def test_restart_and_drain_commands():
    sup, spawner, clock, _, _ = make()
    beat(sup, 0)
    old = engine_child(spawner, 0)
    sup.restart_engine(0)
    assert old.signals == [signal.SIGTERM] and sup.engines[0].state is SlotState.STOPPING
    with pytest.raises(AdminError) as err:
        sup.drain_engine(0)
    assert err.value.code is ErrorCode.CONFLICT
    assert str(err.value) == "engine 0 is already stopping (restart)"  # the AfterExit's text
    die(sup, old, 0)
    assert sup.engines[0].state is SlotState.STARTING
    assert sup.policy.num_failures(("engine", 0)) == 0
    d = engine_child(spawner, 1)
    assert sup.drain_engine(1)["changed"]
    die(sup, d, 0)
    assert sup.engines[1].state is SlotState.DRAINED
    assert sup.drain_engine(1)["changed"] is False
    sup.restart_engine(1)
    assert sup.engines[1].state is SlotState.STARTING
    with pytest.raises(AdminError) as err:
        sup.restart_engine(7)
    assert err.value.code is ErrorCode.UNKNOWN_ENGINE


def test_stop_timeout_sigkills():
    sup, spawner, clock, _, _ = make(num_engines=1)
    c = engine_child(spawner, 0)
    sup.drain_engine(0)
    assert sup.tick() == pytest.approx(clock.t + 10.0)
    clock.t += 10.0
    sup.tick()
    assert c.signals == [signal.SIGTERM, signal.SIGKILL]


def test_scale_up_reuses_kv_figure_and_conflicts_while_in_progress():
    sup, spawner, clock, _, _ = make(max_engines=4)
    beat(sup, 0, kv=3 << 20)
    beat(sup, 1, kv=2 << 20)
    result = sup.scale_to(3)
    assert result["adding"] == [2] and result["changed"]
    spec = engine_child(spawner, 2).spec
    config_json = spec.argv[spec.argv.index("--config-json") + 1]
    assert f'"kv_cache_bytes":{2 << 20}' in config_json and '"kv_source":"reused"' in config_json
    for bad, code in ((4, ErrorCode.CONFLICT), (0, ErrorCode.BAD_ARGUMENT),
                      (5, ErrorCode.BAD_ARGUMENT), ("x", ErrorCode.BAD_ARGUMENT)):
        with pytest.raises(AdminError) as err:
            sup.scale_to(bad)
        assert err.value.code is (ErrorCode.BAD_ARGUMENT if bad in (0, 5, "x") else code)
    assert len(sup.engines) == 3 and len(spawner.children) == 4  # nothing changed
    beat(sup, 2, source="reused")
    assert sup.scale_op is None
    assert sup.status()["engines"][2]["kv_source"] == "reused"


def test_scale_down_drains_the_highest_ids_then_removes_them():
    sup, spawner, clock, _, deaths = make(num_engines=3)
    for i in range(3):
        beat(sup, i)
    result = sup.scale_to(1)
    assert result["removing"] == [1, 2]
    with pytest.raises(AdminError):
        sup.scale_to(2)
    for i in (1, 2):
        c = engine_child(spawner, i)
        assert c.signals == [signal.SIGTERM]
        die(sup, c, 0)
    assert sorted(sup.engines) == [0] and sup.scale_op is None
    assert len(deaths) == 2  # still reported, so nothing waits on them
    assert sup.status()["num_engines"] == 1


def test_shutdown_sigterms_everyone_and_finishes_when_all_exited():
    sup, spawner, clock, notifier, _ = make()
    sup.begin_shutdown()
    live = [c for c in spawner.children if c.returncode is None]
    assert all(c.signals == [signal.SIGTERM] for c in live)
    with pytest.raises(AdminError) as err:
        sup.scale_to(3)
    assert err.value.code is ErrorCode.UNAVAILABLE
    for c in live:
        die(sup, c, 0)
    assert sup.done and sup.exit_code == 0
    assert len(spawner.children) == 3  # nothing restarted


def test_reload_applies_live_fields_and_reports_the_rest(tmp_path):
    sup, spawner, clock, notifier, _ = make()
    new = config_mod.build({"model": "/other", "num_engines": 2, "state_dir": "/s",
                            "hang_timeout_s": 9.0, "restart_backoff_s": 0.5, "stopped_timeout_s": 0.0,
                            "stable_s": 0.0, "stop_timeout_s": 10.0}, environ={})
    result = sup.reload(new)
    assert result["applied"] == {"hang_timeout_s": 9.0, "restart_backoff_s": 0.5}
    assert result["needs_restart"] == ["model"]
    assert sup.hang.hang_timeout_s == 9.0 and sup.policy.backoff_initial_s == 0.5
    assert sup.config.model == "/m"
    assert notifier.lines[-2:] == ["RELOADING=1", "READY=1 0/2 engines up, 0 restarts, frontend starting"]


def test_env_file_layering(tmp_path):
    env = tmp_path / "planaria.env"
    (tmp_path / "engine.json").write_text('{"a": 1}')
    env.write_text("# comment\nPLANARIA_ARGS='--model /m --engines 3 --hang-timeout-s 7 "
                   f"--engine-config-json @{tmp_path}/engine.json'\n"
                   "PLANARIA_LOG_LEVEL=debug\n")
    cli = {"env_file": str(env), "num_engines": 2}
    cfg = config_mod.load(cli, environ={"STATE_DIRECTORY": "/var/lib/p", "RUNTIME_DIRECTORY": "/run/p"})
    assert (cfg.num_engines, cfg.hang_timeout_s, cfg.log_level) == (2, 7.0, "DEBUG")
    assert cfg.engine_config == {"a": 1}
    assert (cfg.state_dir, cfg.runtime_dir) == ("/var/lib/p", "/run/p")
    env.write_text("PLANARIA_ARGS=--model /m --engines 4 --hang-timeout-s 8\n")
    new = config_mod.reload(cfg, cli, environ={"STATE_DIRECTORY": "/var/lib/p",
                                               "RUNTIME_DIRECTORY": "/run/p"})
    assert (new.num_engines, new.hang_timeout_s) == (4, 8.0)
    live, restart = config_mod.live_changes(cfg, new)
    assert live == {"hang_timeout_s": 8.0, "log_level": "INFO"}
    assert restart == ["num_engines", "engine_config"]
    env.write_text("PLANARIA_ARGS=--model /m --bogus\n")
    with pytest.raises(config_mod.ConfigError):
        config_mod.reload(cfg, cli, environ={})
    with pytest.raises(config_mod.ConfigError):
        config_mod.build({"num_engines": 1}, environ={})


def test_an_engine_stopped_by_sigstop_is_killed_without_waiting_for_the_hang_timeout():
    """A SIGSTOPped engine holds its requests (and in EP its peers, inside a collective) and
    can never step: killed once found stopped for stopped_timeout_s (0.5 s), not after the
    hang timeout (here 5 s, 30 by default)."""
    stopped: set[int] = set()
    sup, spawner, clock, _notifier, deaths = make(stopped_pids=stopped, stopped_timeout_s=0.5)
    beat(sup, 0, step=1, has_work=True)
    beat(sup, 1, step=1, has_work=True)
    e0 = engine_child(spawner, 0)
    stopped.add(e0.pid)
    next_at = sup.tick()
    assert next_at <= clock() + 0.25  # looked at again within the poll period
    clock.t += 0.3
    sup.tick()
    assert signal.SIGKILL not in e0.signals  # 0.3 s stopped: not yet
    clock.t += 0.3
    sup.tick()
    assert e0.signals == [signal.SIGKILL]
    run = sup.engines[0].current
    assert "stopped (SIGSTOP)" in run.kill_reason and run.killed_stopped
    die(sup, e0)
    assert deaths[-1][0] == 0 and "stopped (SIGSTOP)" in deaths[-1][2]
    assert signal.SIGKILL not in engine_child(spawner, 1).signals


def test_a_stop_that_ends_in_time_or_the_watch_turned_off_kills_nothing():
    stopped: set[int] = set()
    sup, spawner, clock, _n, _d = make(stopped_pids=stopped, stopped_timeout_s=0.5)
    e0 = engine_child(spawner, 0)
    stopped.add(e0.pid)
    sup.tick()
    clock.t += 0.4
    stopped.discard(e0.pid)  # SIGCONT in time
    sup.tick()
    stopped.add(e0.pid)
    clock.t += 0.4
    sup.tick()  # a new stop starts its own clock
    assert not e0.signals
    off, spawner2, clock2, _n2, _d2 = make(stopped_pids={c for c in range(1, 100)}, stopped_timeout_s=0)
    for _ in range(5):
        clock2.t += 1.0
        off.tick()
    assert not any(c.signals for c in spawner2.children)


def test_a_restarted_replica_engine_takes_the_serving_engines_kv_figure():
    """No second memory profile for the same model on the same host (seconds of an engine's
    restart): a replica engine that died restarts with the figure the others serve with."""
    import json

    sup, spawner, clock, _n, _d = make(2)
    beat(sup, 0, step=1, kv=6 << 20, source="profiled")
    beat(sup, 1, step=1, kv=6 << 20, source="profiled")
    die(sup, engine_child(spawner, 0))
    clock.t += 5.0
    sup.tick()
    argv = engine_child(spawner, 0).spec.argv
    config = json.loads(argv[argv.index("--config-json") + 1])
    assert config["kv_cache_bytes"] == 6 << 20 and config["kv_source"] == "reused"
    given, spawner2, clock2, _n2, _d2 = make(2, engine_config={"kv_cache_bytes": 1 << 20})
    beat(given, 1, step=1, kv=1 << 20, source="given")
    die(given, engine_child(spawner2, 0))
    clock2.t += 5.0
    given.tick()
    argv = engine_child(spawner2, 0).spec.argv
    assert "kv_source" not in json.loads(argv[argv.index("--config-json") + 1])  # the operator's figure stands


def frontend_beat(sup, spawner, lag_s=0.0):
    sup.on_frontend_beat(spawner.live(("frontend",))[-1].pid, lag_s)


def test_a_frontend_whose_event_loop_stops_answering_is_killed_and_restarted_with_its_engines():
    """No liveness beat for --frontend-hang-timeout-s after the first: SIGKILL, the kill
    reason in status, a restart counted, and the engines recycled with the new frontend."""
    sup, spawner, clock, _, _ = make(frontend_hang_timeout_s=4.0)
    beat(sup, 0)
    beat(sup, 1)
    fe = spawner.live(("frontend",))[0]
    for _ in range(10):  # answering every second: left alone
        frontend_beat(sup, spawner)
        beat(sup, 0)
        beat(sup, 1)
        clock.t += 1.0
        assert sup.tick() <= clock.t + 4.0
    assert not fe.signals
    assert sup.status()["frontend"]["last_answer_age_s"] == 1.0
    clock.t += 2.9  # 3.9 s since the last answer
    sup.tick()
    assert not fe.signals
    clock.t += 0.1
    sup.tick()
    assert fe.signals == [signal.SIGKILL]
    sup.tick()
    assert fe.signals == [signal.SIGKILL]  # killed once
    die(sup, fe)
    status = sup.status()["frontend"]
    assert status["reason"] == "frontend hung: event loop did not answer for 4.0 s (limit 4 s)"
    assert all(c.signals == [signal.SIGKILL] for c in (engine_child(spawner, 0), engine_child(spawner, 1)))
    clock.t = sup.frontend.due_at
    sup.tick()
    new_fe = spawner.live(("frontend",))[0]
    assert new_fe is not fe and sup.frontend.state is SlotState.STARTING
    assert sup.policy.restarts(("frontend",)) == 1
    assert sup.status()["frontend"]["reason"].startswith("frontend hung")  # kept for status
    assert sup.status()["frontend"]["last_answer_age_s"] is None


def test_a_starting_frontend_gets_the_start_grace_and_old_beats_do_not_count():
    sup, spawner, clock, _, _ = make(frontend_hang_timeout_s=4.0, handshake_timeout_s=30.0)
    fe = spawner.live(("frontend",))[0]
    clock.t += 29.0  # loading its tokenizer: no answer yet, not hung
    sup.tick()
    assert not fe.signals
    sup.on_frontend_beat(fe.pid + 999)  # not the frontend's pid: ignored
    clock.t += 1.0
    sup.tick()
    assert fe.signals == [signal.SIGKILL]
    die(sup, fe)
    assert sup.status()["frontend"]["reason"].startswith(
        "frontend hung: event loop never answered in 30.0 s since its start (limit 30 s)")
    clock.t = sup.frontend.due_at
    sup.tick()
    new_fe = spawner.live(("frontend",))[0]
    sup.on_frontend_beat(fe.pid)  # the killed one's late beat: ignored
    assert sup.status()["frontend"]["num_answers"] == 0
    frontend_beat(sup, spawner)
    clock.t += 3.0
    sup.tick()
    assert not new_fe.signals


def test_frontend_hang_check_off_at_zero_and_not_while_shutting_down():
    sup, spawner, clock, _, _ = make(frontend_hang_timeout_s=0.0)
    fe = spawner.live(("frontend",))[0]
    frontend_beat(sup, spawner)
    clock.t += 1000.0
    sup.tick()
    assert not fe.signals
    on, spawner2, clock2, _n, _d = make(frontend_hang_timeout_s=4.0)
    frontend_beat(on, spawner2)
    on.begin_shutdown()
    fe2 = spawner2.live(("frontend",))[0]
    clock2.t += 5.0
    on.tick()
    assert fe2.signals == [signal.SIGTERM]  # the drain's, not a hang kill


def test_reload_changes_the_frontend_hang_timeout_live():
    sup, spawner, clock, _, _ = make(frontend_hang_timeout_s=20.0)
    new = config_mod.build({**{f: getattr(sup.config, f) for f in sup.config.__struct_fields__},
                            "frontend_hang_timeout_s": 3.0}, environ={})
    assert sup.reload(new)["applied"] == {"frontend_hang_timeout_s": 3.0}
    frontend_beat(sup, spawner)
    clock.t += 3.0
    sup.tick()
    assert spawner.live(("frontend",))[0].signals == [signal.SIGKILL]
    with pytest.raises(config_mod.ConfigError, match="frontend-hang-timeout-s"):
        config_mod.build({"model": "/m", "frontend_hang_timeout_s": 0.5}, environ={})
