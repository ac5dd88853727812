"""The supervisor's logic: one frontend and N engine cores, kept alive.

No sockets, no waiting: the run loop (daemon/loop.py) reports what happened —
``on_exit(child)`` when a child's sentinel fires, ``on_heartbeat(beat)`` per engine
heartbeat, ``on_frontend_beat(pid)`` per frontend liveness beat — and calls ``tick()``,
which acts on timers and returns when it wants to be called next. The spawner, the
clock, the systemd notifier and the death reporter are injected; tests pass fakes
(tests/daemon/test_supervisor_logic.py).

What it does:

- an engine that exits for any reason is reported dead to the frontend at once
  (``report_dead(engine_id, pid, reason)``: ENGINE_CORE_DEAD on the frontend's PULL
  socket), then restarted as ``RestartPolicy`` decides (backoff, flap hold-off, retry
  limit); planned stops (restart, drain, scale-down, shutdown) are not failures;
- an engine with work and no step progress for ``hang_timeout_s``, or no heartbeat at
  all for twice that (``HangDetector`` on its heartbeats), is SIGKILLed, reported and
  restarted like any dead engine; so is one found stopped by job control (SIGSTOP) for
  ``stopped_timeout_s`` (0.3 s; ``StoppedWatch``, its state looked at every 0.15 s), which
  cannot step however long one waits;
- a frontend whose event loop stops answering (no liveness beat for
  ``frontend_hang_timeout_s`` after its first; ``FrontendWatch``) is SIGKILLed and
  restarted like a dead one;
- when the frontend dies, the engines go with it (their handshake was with the dead
  process; a new frontend would not know them) and start again with the new frontend;
- what belongs to one process (pid, start, kill reason, heartbeat, planned exit) lives on
  its slot's ``Incarnation`` (``slot.current``, daemon/slot.py), made at spawn and dropped
  whole at its exit: nothing of a dead process reaches the next one;
- with ``--kv-salvage on`` each engine keeps its KV cache in a file of the KV segment
  directory (daemon/kv_segments.py), made when the loop starts (``open_kv_segments``) and
  named to engines and standbys in their environment; when an engine or a standby exits,
  for whatever reason, its file is kept ``kv_segment_ttl_s`` for a survivor to copy its
  requests' KV blocks out of, then removed by ``tick()``; a file of no known process
  (an exit never seen) gets the same delay; all go at a clean stop (``close_kv_segments``);
- systemd hears READY=1 when the first engine serves, a STATUS= line on every change,
  STOPPING=1 on shutdown; the admin commands (daemon/commands/) call the public methods.

Two mixins hold parts of it: the KV segment directory (daemon/supervisor_kv.py) and the
admin operations, restart, drain and scale (daemon/supervisor_ops.py).
"""

from __future__ import annotations

import itertools
import logging
import signal
from pathlib import Path
from typing import Any, Callable, Protocol

from planaria.common.logging import get_logger
from planaria.daemon.children import Child, ChildSpec, describe_exit
from planaria.daemon.config import ServeConfig, live_changes
from planaria.daemon.ep_supervisor import POLL_S as EP_POLL_S, EPSupervisor
from planaria.daemon.frontend_watch import FrontendWatch
from planaria.daemon.hang_detector import HangDetector, StoppedWatch
from planaria.daemon.kv_segments import KVSegmentDir
from planaria.daemon.launch import FRONTEND_KEY, Launcher, engine_key
from planaria.daemon.restart_policy import GiveUp, HoldOff, RestartAt, RestartNow
from planaria.daemon.slot import AfterExit, Incarnation, ScaleOp, Slot, SlotState
from planaria.daemon.standby_pool import StandbyPool
from planaria.daemon.supervisor_kv import KVSegmentsMixin
from planaria.daemon.supervisor_ops import AdminOps

EXIT_OK, EXIT_FAILURE = 0, 1
# engine/proc.py's HANDOVER_SIGNAL (not imported: the engine package pulls in torch)
HANDOVER_SIGNAL = signal.SIGUSR2
STOPPED_POLL_S = 0.2  # how often engines are looked at for a job-control stop (stopped_timeout_s)
EXIT_CONFIG = 2  # every engine was refused for its configuration: restarting cannot help


class Spawner(Protocol):
    def spawn(self, spec: ChildSpec) -> Child: ...


class Notifier(Protocol):
    def ready(self, status: str | None = None) -> bool: ...
    def status(self, text: str) -> bool: ...
    def stopping(self, status: str | None = None) -> bool: ...
    def reloading(self, status: str | None = None) -> bool: ...


class _NullNotifier:
    def ready(self, status=None): return False
    def status(self, text): return False
    def stopping(self, status=None): return False
    def reloading(self, status=None): return False


def _is_stopped(pid: int | None) -> bool:
    """Whether the process is stopped (SIGSTOP/SIGTSTP, or stopped under a tracer)."""
    import psutil

    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def _is_job_stopped(pid: int) -> bool:
    """Stopped by job control (SIGSTOP/SIGTSTP: state T); a tracer's stop (a debugger at
    its prompt, state t) is not: nobody kills a process being debugged for it."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


class Supervisor(KVSegmentsMixin, AdminOps):
    def __init__(self, config: ServeConfig, spawner: Spawner, clock: Callable[[], float], *,
                 launcher: Launcher | None = None, notifier: Notifier | None = None,
                 report_dead: Callable[..., None] | None = None,
                 report_cause: Callable[..., None] | None = None,
                 is_job_stopped: Callable[[int], bool] = _is_job_stopped) -> None:
        self.config = config
        self.spawner = spawner
        self.clock = clock
        self.launcher = launcher or Launcher(config)
        self.notifier = notifier or _NullNotifier()
        # report_dead(engine_id, pid, reason, suspects=[...]) and report_cause(engine_id, pid,
        # reason, cause, suspects=[...]): ENGINE_CORE_DEAD to the frontend (daemon/loop.py)
        self.report_dead = report_dead or (lambda engine_id, pid, reason, suspects=(): None)
        self.report_cause = report_cause or (lambda engine_id, pid, reason, cause, suspects=(): None)
        self.policy = config.restart_policy()
        self.hang = HangDetector(config.hang_timeout_s)
        self.stopped = StoppedWatch(config.stopped_timeout_s)
        # start-up grace: as long as engines wait to reach a frontend (handshake timeout)
        self.frontend_watch = FrontendWatch(config.frontend_hang_timeout_s, config.handshake_timeout_s)
        self.is_job_stopped = is_job_stopped
        self.frontend = Slot(FRONTEND_KEY)
        self.engines: dict[int, Slot] = {i: Slot(engine_key(i)) for i in range(config.num_engines)}
        self.scale_op: ScaleOp | None = None
        self.shutting_down = False
        self.exit_code = EXIT_OK
        self.started_at = clock()
        self.num_deaths_reported = 0
        self._op_ids = itertools.count(1)
        self._ready_sent = False
        self._last_status = ""
        self.log = get_logger("planaria.supervisor")
        self.ep: EPSupervisor | None = None  # the EP half when config.parallel == "ep" (set by serve)
        self.standby = (StandbyPool(config.num_standby, self.launcher, spawner, clock, self.log)
                        if config.parallel == "ep" and config.num_standby > 0 else None)
        self.kv_segments: KVSegmentDir | None = None  # open_kv_segments (--kv-salvage on)
        self.kv_segments_error: str | None = None  # why salvage is off although configured
        self._kv_orphan_scan_at = 0.0

    # -- views --------------------------------------------------------------------------
    def slots(self) -> list[Slot]:
        return [self.frontend, *(self.engines[i] for i in sorted(self.engines))]

    def live_children(self) -> list[Child]:
        standbys = self.standby.children() if self.standby is not None else []
        return [*(s.child for s in self.slots() if s.child is not None), *standbys]

    @property
    def done(self) -> bool:
        """Shutting down and no child left."""
        return self.shutting_down and not self.live_children()

    def rank(self, engine_id: int) -> int:
        return sorted(self.engines).index(engine_id)

    def num_up(self) -> int:
        return sum(s.state is SlotState.RUNNING for s in self.engines.values())

    def _slot_log(self, slot: Slot):
        if slot.key == FRONTEND_KEY:
            return self.log.bind(child="frontend", pid=slot.pid)
        return self.log.bind(engine_id=slot.engine_id, rank=self.rank(slot.engine_id), pid=slot.pid)

    # -- starting -----------------------------------------------------------------------
    def start(self) -> None:
        self._spawn(self.frontend)  # then the engines, all WAITING for it
        self._notify_status()

    def _frontend_up(self) -> bool:
        return self.frontend.state in (SlotState.STARTING, SlotState.RUNNING)

    def _spawn(self, slot: Slot) -> None:
        now = self.clock()
        if slot.key != FRONTEND_KEY and not self._frontend_up():
            slot.state, slot.reason = SlotState.WAITING, "waiting for the frontend"
            return
        if slot.key != FRONTEND_KEY and slot.num_starts > 0:
            # A restarted engine takes the serving engines' KV figure (in EP also the group's
            # published one) instead of profiling again: the same model on the same host.
            figures = self._kv_figures(but=slot)
            if self.ep is not None:
                slot.extra_config = self.ep.reused_kv_config(figures) or slot.extra_config
            elif figures and not {"num_kv_blocks", "kv_cache_bytes"} & set(self.config.engine_config):
                slot.extra_config = {**slot.extra_config, "kv_cache_bytes": min(figures), "kv_source": "reused"}
        slot.num_starts += 1
        spec = (self.launcher.frontend(len(self.engines)) if slot.key == FRONTEND_KEY
                else self.launcher.engine(slot.engine_id, slot.extra_config, num_engines=len(self.engines)))
        warm = self.standby.take(spec, now) if self.standby is not None else None
        run = slot.begin(warm or self.spawner.spawn(spec), now)
        slot.state, slot.due_at, slot.held = SlotState.STARTING, None, False
        self.policy.record_start(slot.key, now)
        self._slot_log(slot).info("started", restarts=self.policy.restarts(slot.key),
                                  **({"from_standby": True} if warm is not None else {}))
        if slot.key == FRONTEND_KEY:
            self.frontend_watch.start(run.pid, now)
            for engine in self.engines.values():
                if engine.state is SlotState.WAITING:
                    self._spawn(engine)

    # -- events from the loop -----------------------------------------------------------
    def on_exit(self, child: Child) -> None:
        """``child``'s sentinel fired: reap it, report it, decide what comes next."""
        code = child.poll()
        if code is None:
            return  # spurious wakeup
        slot = next((s for s in self.slots() if s.child is child), None)
        if slot is None or slot.key != FRONTEND_KEY:  # an engine or a standby: its KV is kept a while
            self._keep_kv_segment(child.pid, self.clock())
        if slot is None:
            if self.standby is not None and self.standby.on_exit(child, self.clock(), describe_exit(code)):
                self._notify_status()
            return
        now = self.clock()
        run = slot.current
        reason = run.kill_reason or describe_exit(code)
        log = self._slot_log(slot)
        if slot.key != FRONTEND_KEY:
            # First, before anything else: the frontend must stop waiting on this engine.
            if not run.death_reported:
                self._report_dead(slot, reason)
            if self._frontend_up():  # what ended it, for the frontend's poison quarantine
                self.report_cause(slot.engine_id, child.pid, reason, self._cause(run, code),
                                  suspects=self._suspects(slot))
            Path(self.launcher.flight_record_path(slot.engine_id)).unlink(missing_ok=True)
            self.hang.forget(slot.engine_id)
            if self.ep is not None:
                self.ep.forget_engine(slot.engine_id, child.pid)
        else:
            self.frontend_watch.forget()
        after = slot.end().after_exit  # the run is over: nothing of it reaches the next
        slot.reason = reason
        planned = after is not AfterExit.UNPLANNED
        log.log(logging.INFO if planned else logging.WARNING, "exited", reason=reason,
                planned=after.value if planned else None)
        if self.shutting_down or after is AfterExit.STOP:
            slot.state = SlotState.STOPPED
        elif after is AfterExit.RESTART:
            self._spawn(slot)
        elif after is AfterExit.DRAIN:
            slot.state = SlotState.DRAINED
        elif after is AfterExit.REMOVE:
            del self.engines[slot.engine_id]
            self.policy.forget(slot.key)
        elif after is AfterExit.FRONTEND:
            slot.state = SlotState.WAITING
            if self._frontend_up():
                self._spawn(slot)
        else:
            self.policy.record_exit(slot.key, now, code, reason)
            if slot.key == FRONTEND_KEY:
                self._frontend_died()
            self._decide(slot)
        self._update_scale_op()
        self._notify_status()

    @staticmethod
    def _cause(run: Incarnation, code: int) -> str:
        """"external" when the engine did not end itself: a SIGKILL that was not the
        supervisor's, or the watchdog's kill of a process found stopped (SIGSTOP); else
        "fault" (an exit code, a crash signal, a hang while running)."""
        if run.kill_reason:
            return "external" if run.killed_stopped else "fault"
        return "external" if code == -signal.SIGKILL else "fault"

    def on_exiting(self, child: Child) -> None:
        """An exit sentinel of ``child`` fired: its threads are gone, the kernel is still
        freeing its memory. Report the engine dead now; ``on_exit`` reaps it later."""
        slot = next((s for s in self.engines.values() if s.child is child), None)
        if slot is None or slot.current.death_reported:
            return
        self._report_dead(slot, slot.current.kill_reason
                          or "the engine process is exiting (its threads ended)")

    def _suspects(self, slot: Slot) -> list[str]:
        """The requests in their first step when the engine died (its flight record)."""
        from planaria.engine.flight_record import read_suspects

        return read_suspects(self.launcher.flight_record_path(slot.engine_id)) or []

    def _report_dead(self, slot: Slot, reason: str) -> None:
        if self._frontend_up():
            self.report_dead(slot.engine_id, slot.pid, reason, suspects=self._suspects(slot))
            self.num_deaths_reported += 1
        slot.current.death_reported = True

    def _frontend_died(self) -> None:
        """The engines' handshake was with the dead frontend: restart them with the next."""
        for engine in self.engines.values():
            run = engine.current
            if run is not None and run.after_exit not in (
                    AfterExit.REMOVE, AfterExit.DRAIN, AfterExit.STOP):
                run.after_exit = AfterExit.FRONTEND
                run.kill_reason = "its frontend died"
                engine.state = SlotState.STOPPING
                run.child.send_signal(signal.SIGKILL)
            elif engine.state is SlotState.BACKOFF:
                engine.state, engine.due_at = SlotState.WAITING, None

    def _last_one(self, slot: Slot) -> bool:
        """No other engine is starting, serving, or coming back without a hold (the
        availability floor applies to ``slot``); always False for the frontend."""
        if slot.key == FRONTEND_KEY:
            return False
        return not any(s is not slot and (s.state in (SlotState.STARTING, SlotState.RUNNING)
                                          or (s.state is SlotState.BACKOFF and not s.held))
                       for s in self.engines.values())

    def _decide(self, slot: Slot) -> None:
        action = self.policy.decide(slot.key, self.clock(), last_one=self._last_one(slot))
        slot.held = isinstance(action, HoldOff)
        if isinstance(action, RestartNow):
            self._spawn(slot)
        elif isinstance(action, (RestartAt, HoldOff)):
            slot.state = SlotState.BACKOFF
            slot.due_at = action.t if isinstance(action, RestartAt) else action.until
            if isinstance(action, HoldOff):
                slot.reason = action.reason
            elif action.floor:
                slot.reason = (f"{slot.reason}; availability floor: the node's last engine, "
                               f"restarted at the backoff cap ({self.policy.backoff_max_s:g}s) "
                               f"despite its flap hold")
                self._slot_log(slot).warning("availability floor", restart_at_cap_s=self.policy.backoff_max_s)
            self._slot_log(slot).info("restart scheduled", in_s=round(slot.due_at - self.clock(), 3))
        elif isinstance(action, GiveUp):
            slot.state, slot.reason = SlotState.FAILED, action.reason
            self._slot_log(slot).error("giving up", reason=action.reason)
            if slot.key == FRONTEND_KEY or all(
                    s.state is SlotState.FAILED for s in self.engines.values()):
                self.log.error("nothing left to serve with; shutting down")
                config_error = slot.key != FRONTEND_KEY and all(
                    self._failed_for_config(s) for s in self.engines.values())
                self.exit_code = EXIT_CONFIG if config_error else EXIT_FAILURE
                self.begin_shutdown()
        if (slot.held or slot.state is SlotState.FAILED) and not self.shutting_down:
            # this one is not coming back soon: a held engine that is now the node's last
            # is decided again (the availability floor brings it back)
            for other in self.engines.values():
                if other is not slot and other.held and self._last_one(other):
                    self._decide(other)

    def _failed_for_config(self, slot: Slot) -> bool:
        exits = self.policy.last_exits(slot.key)
        return bool(exits) and exits[-1][1] in self.policy.fatal_exit_codes

    def on_heartbeat(self, beat) -> None:
        slot = self.engines.get(beat.engine_index)
        run = slot.current if slot is not None else None
        if run is None or run.pid != beat.pid:
            return  # an older incarnation, or a removed engine
        now = self.clock()
        run.heartbeat = beat
        if beat.exit_sentinel_tids and not getattr(run.child, "watched_tids", True):
            watched = run.child.watch_threads(beat.exit_sentinel_tids)
            self._slot_log(slot).debug("exit sentinels", watched=watched)
        self.hang.observe(slot.engine_id, beat.step_counter, beat.has_work, now)
        if slot.state is SlotState.STARTING and beat.state == "running":
            slot.state = SlotState.RUNNING
            self._slot_log(slot).info("serving", kv_cache_bytes=beat.kv_cache_bytes,
                                      kv_source=beat.kv_source,
                                      startup_s=round(now - run.started_at, 3))
            if self.frontend.state is SlotState.STARTING:
                self.frontend.state = SlotState.RUNNING
            if self.standby is not None:
                self.standby.enable(now)  # now that an engine has started, not before
            self._update_scale_op()
            self._notify_status()
        if slot.state is SlotState.RUNNING:
            self.policy.record_healthy(slot.key, now)
            if beat.step_counter > 0:  # it did work: a death now is not a start-up failure
                self.policy.record_served(slot.key, now)

    def on_frontend_beat(self, pid: int, lag_s: float = 0.0, routing=None) -> None:
        """The event loop of frontend process ``pid`` answered (the loop checked that the
        kernel's sender pid is ``pid``); beats of an older frontend are ignored. ``routing``:
        its router's figures (common.liveness.RoutingSummary), for status."""
        self.frontend_watch.answered(pid, self.clock(), lag_s, routing)

    # -- timers -------------------------------------------------------------------------
    def tick(self) -> float | None:
        """Act on what is due; returns the clock time of the next thing due (or None)."""
        now = self.clock()
        if self.ep is not None and not self.shutting_down:
            self._follow_placement()
        for slot in self.slots():
            run = slot.current
            if slot.state is SlotState.BACKOFF and slot.due_at is not None and slot.due_at <= now:
                self._spawn(slot)
            elif (slot.state is SlotState.STOPPING and run is not None and run.kill_at is not None
                  and run.kill_at <= now):
                self._slot_log(slot).warning("did not stop in time; SIGKILL")
                run.kill_at = None
                run.child.send_signal(signal.SIGKILL)
        if not self.shutting_down:
            self._kill_stopped(now)
            self._kill_hung_frontend(now)
            for engine_id in self.hang.check(now):
                slot = self.engines.get(engine_id)
                why = self.hang.why_hung(engine_id, now)
                self.hang.forget(engine_id)
                if slot is None or slot.state not in (SlotState.STARTING, SlotState.RUNNING):
                    continue
                run = slot.current
                run.kill_reason = why
                run.killed_stopped = _is_stopped(run.pid)
                self._slot_log(slot).error("hung; SIGKILL", reason=run.kill_reason,
                                           **({"stopped": True} if run.killed_stopped else {}))
                run.child.send_signal(signal.SIGKILL)
        if self.frontend.state is SlotState.RUNNING:
            self.policy.record_healthy(FRONTEND_KEY, now)
        self._update_scale_op()
        self._notify_status()
        times = [s.due_at for s in self.slots() if s.due_at is not None]
        times += [s.current.kill_at for s in self.slots()
                  if s.current is not None and s.current.kill_at is not None]
        if self._frontend_up() and not self.shutting_down:
            times.append(self.frontend_watch.deadline())
        if any(s.state in (SlotState.STARTING, SlotState.RUNNING) for s in self.engines.values()):
            times.append(now + self.config.hang_timeout_s / 4)
        if self.ep is not None:
            times.append(now + EP_POLL_S)
        if self.config.stopped_timeout_s > 0 and any(s.child is not None for s in self.engines.values()):
            times.append(now + min(STOPPED_POLL_S, self.config.stopped_timeout_s / 2))
        if self.standby is not None and not self.shutting_down:
            times.append(self.standby.tick(now))
        times.append(self._tick_kv_segments(now))
        return min((t for t in times if t is not None), default=None)

    def _kill_hung_frontend(self, now: float) -> None:
        """SIGKILL a frontend whose event loop has not answered in time: it serves nothing
        and would never exit by itself. Its exit is then a failure like any other (restart
        policy, its engines recycled)."""
        slot = self.frontend
        if slot.child is None or slot.state not in (SlotState.STARTING, SlotState.RUNNING):
            return
        why = self.frontend_watch.why_hung(now)
        if why is None:
            return
        self.frontend_watch.forget()  # judged once; the next start is watched afresh
        slot.current.kill_reason = why
        self._slot_log(slot).error("hung; SIGKILL", reason=why)
        slot.current.child.send_signal(signal.SIGKILL)

    def _kill_stopped(self, now: float) -> None:
        """SIGKILL a serving engine stopped by job control for ``stopped_timeout_s``: it holds
        its requests (and, in EP, its peers inside a collective) and cannot step."""
        if self.config.stopped_timeout_s <= 0:
            return
        for slot in self.engines.values():
            run = slot.current
            if run is None or slot.state not in (SlotState.STARTING, SlotState.RUNNING):
                continue
            stopped_s = self.stopped.observe(run.pid, self.is_job_stopped(run.pid), now)
            if stopped_s is None:
                continue
            self.stopped.forget(run.pid)
            self.hang.forget(slot.engine_id)
            run.kill_reason = (f"frozen: stopped (SIGSTOP) for {stopped_s:.1f}s "
                               f"(limit {self.config.stopped_timeout_s:g}s)")
            run.killed_stopped = True
            self._slot_log(slot).error("stopped; SIGKILL", reason=run.kill_reason, stopped=True)
            run.child.send_signal(signal.SIGKILL)

    # -- systemd ------------------------------------------------------------------------
    def status_line(self) -> str:
        restarts = sum(self.policy.restarts(s.key) for s in self.slots())
        failed = [s for s in self.engines.values() if s.state is SlotState.FAILED]
        return (f"{self.num_up()}/{len(self.engines)} engines up, {restarts} restarts, "
                f"frontend {self.frontend.state.value}"
                + (f", engine {failed[0].engine_id} failed: {failed[0].reason}"
                   + (f" (+{len(failed) - 1} more failed)" if len(failed) > 1 else "")
                   if failed else "")
                + (", stopping" if self.shutting_down else ""))

    def _notify_status(self) -> None:
        line = self.status_line()
        if not self._ready_sent and not self.shutting_down and self.num_up() > 0:
            self._ready_sent = True
            self._last_status = line
            self.notifier.ready(status=line)
            self.log.info("ready", status=line)
        elif line != self._last_status:
            self._last_status = line
            self.notifier.status(line)

    # -- shutdown, reload ---------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """SIGTERM every child (they drain), SIGKILL what is left after stop_timeout_s."""
        if self.shutting_down:
            return
        self.shutting_down = True
        self.notifier.stopping(status=f"stopping: draining {len(self.live_children())} processes")
        self.log.info("shutting down", stop_timeout_s=self.config.stop_timeout_s)
        for slot in self.slots():
            if slot.child is not None:
                self._stop(slot, AfterExit.STOP)
            elif slot.state is not SlotState.FAILED:
                slot.state, slot.due_at = SlotState.STOPPED, None
        if self.standby is not None:
            self.standby.stop(signal.SIGTERM)

    def kill_all(self) -> None:
        """A second stop request: do not wait for the drain."""
        for slot in self.slots():
            if slot.child is not None:
                slot.child.send_signal(signal.SIGKILL)
        if self.standby is not None:
            self.standby.stop(signal.SIGKILL)

    def _stop(self, slot: Slot, after_exit: AfterExit, sig: int = signal.SIGTERM) -> None:
        run = slot.current
        run.after_exit = after_exit
        slot.state = SlotState.STOPPING
        run.kill_at = self.clock() + self.config.stop_timeout_s
        if sig == signal.SIGTERM and self._hands_over(slot, after_exit):
            sig = HANDOVER_SIGNAL
        run.child.send_signal(sig)

    def _hands_over(self, slot: Slot, after_exit: AfterExit) -> bool:
        """A restart, drain or scale-down of one engine while another serves, with its KV
        in a segment that outlives it: the engine hands its requests over at once (they
        move with their KV) instead of finishing them (engine/proc.py HANDOVER_SIGNAL)."""
        if self.kv_segments is None or after_exit not in (AfterExit.RESTART, AfterExit.DRAIN, AfterExit.REMOVE):
            return False
        return any(other is not slot and other.state is SlotState.RUNNING for other in self.engines.values())

    def reload(self, new: ServeConfig) -> dict[str, Any]:
        """Apply what can change live; returns {"applied": {...}, "needs_restart": [...]}."""
        self.notifier.reloading(status="reloading configuration")
        live, needs_restart = live_changes(self.config, new)
        keep = {k: getattr(self.config, k) for k in self.config.__struct_fields__
                if k not in live}
        self.config = type(self.config)(**{**keep, **live})
        self.launcher.config = self.config
        self.policy.reconfigure(
            backoff_initial_s=self.config.restart_backoff_s,
            backoff_max_s=self.config.restart_backoff_max_s,
            flap_window_s=self.config.flap_window_s, flap_max_exits=self.config.flap_max_exits,
            flap_hold_s=self.config.flap_hold_s, retry_limit=self.config.retry_limit,
            stable_s=self.config.stable_s, served_delay_s=self.config.served_restart_delay_s,
            served_max_restarts=self.config.served_restart_max)
        self.hang.hang_timeout_s = self.config.hang_timeout_s
        self.stopped.timeout_s = self.config.stopped_timeout_s
        self.frontend_watch.reconfigure(self.config.frontend_hang_timeout_s, self.config.handshake_timeout_s)
        if self.ep is not None and "max_engines" in live:
            self.ep.reconfigure(self.config.max_engines)
        if "log_level" in live:
            logging.getLogger().setLevel(self.config.log_level)
        self.log.info("reloaded", applied=live, needs_restart=needs_restart)
        if needs_restart:
            self.log.warning("changed settings that need a restart were not applied",
                             fields=needs_restart)
        self.notifier.ready(status=self.status_line())
        self._last_status = self.status_line()
        return {"applied": live, "needs_restart": needs_restart}

    def status(self) -> dict[str, Any]:
        now = self.clock()

        def child(slot: Slot) -> dict[str, Any]:
            run = slot.current
            return {"state": slot.state.value, "pid": slot.pid,
                    "uptime_s": round(now - run.started_at, 3) if run is not None else None,
                    "restarts": self.policy.restarts(slot.key), "reason": slot.reason}

        engines = []
        for engine_id in sorted(self.engines):
            slot = self.engines[engine_id]
            hb = slot.current.heartbeat if slot.current is not None else None
            engines.append({
                "engine_id": engine_id, "rank": self.rank(engine_id), **child(slot),
                "num_running": hb.num_running if hb else None,
                "num_waiting": hb.num_waiting if hb else None,
                "kv_usage": hb.kv_usage if hb else None,
                "kv_cache_bytes": hb.kv_cache_bytes if hb else None,
                "num_kv_blocks": hb.num_kv_blocks if hb else None,
                "kv_source": hb.kv_source if hb else None,
                "dtype": (hb.dtype or None) if hb else None,
                "step_counter": hb.step_counter if hb else None,
                "salvage": {"requests": hb.num_salvaged_requests, "blocks": hb.num_salvaged_blocks,
                            "handed_over": hb.num_handed_over} if hb else None})
        ep = self.ep_status()
        if ep is not None:
            self.ep.annotate(engines, ep)
        op = self.scale_op
        return {"status": self.status_line(), "http": self.config.http, "model": self.config.model,
                "uptime_s": round(now - self.started_at, 3), "shutting_down": self.shutting_down,
                "num_engines": len(self.engines), "num_up": self.num_up(),
                "max_engines": self.config.max_engines,
                "num_deaths_reported": self.num_deaths_reported,
                "scale": None if op is None else {"op_id": op.op_id, "target": op.target,
                                                  "adding": op.adding, "removing": op.removing},
                "frontend": {**child(self.frontend), **self.frontend_watch.status(now)},
                "routing": self.frontend_watch.routing(),
                "engines": engines,
                "state_dir": self.config.state_dir, "parallel": self.config.parallel, "ep": ep,
                "standby": self.standby.status(now) if self.standby is not None else None,
                "kv_segments": self.kv_segments_status()}
