"""The supervisor's run loop: one zmq poller over everything that can wake it.

    child pidfds (exit), engines' thread pidfds (exiting)  |  heartbeat PULL  |  frontend liveness PULL  |  control ROUTER  |  signal wakeup fd
                         v
                  Supervisor.on_exit / on_exiting / on_heartbeat / on_frontend_beat / admin execute / stop, reload
                         v
                  Supervisor.tick() -> next deadline -> poll timeout

No sleep-polling: the loop blocks in ``poll`` until an event or the next deadline (a
restart due, a SIGKILL due, the hang checks, the watchdog ping, a dead engine's KV segment
due for removal). The KV segment directory (``--kv-salvage on``, daemon/kv_segments.py) is
made before the first child starts and removed, with every segment left, when the loop
ends. A frontend liveness beat counts only from the pid the kernel reports for its sender
(common/liveness.py).
``WATCHDOG=1`` is sent from the loop itself, so a wedged or stopped loop stops the pings and systemd's
watchdog fires.

No frame ends the loop (it would end the daemon and every child with it): a heartbeat that
does not decode (any bytes, any nesting: ``engine.heartbeat.decode`` raises only
``msgspec.DecodeError``), or whose handling raises, is dropped with a warning (rate-limited,
``num_bad_heartbeats``); one over ``HEARTBEAT_MAX_BYTES`` never arrives (``zmq.MAXMSGSIZE``
drops it and its connection); the control socket answers or drops bad requests itself
(daemon/control.py); the signal wakeup socket, the pidfd handlers and the frontend
liveness reader are guarded the same way (``num_failed_events``). The sockets' files are
0600 (``common.sockets.bind_private``). The PUSH socket that tells the frontend an engine
died is ``engine.death_reporter.DeathReporter`` (serve builds it).
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Callable

import msgspec
import zmq

from planaria.common.envelope import AdminRequest, Ok
from planaria.common.errors import UnknownCommandError
from planaria.common.logging import get_logger, should_log
from planaria.common.sockets import bind_private
from planaria.daemon.control import ControlServer

log = get_logger("planaria.loop")

HEARTBEAT_MAX_BYTES = 64 * 1024  # a heartbeat (or a frontend liveness beat) is a few hundred bytes
MAX_HEARTBEATS_PER_POLL = 1000


def command_handler(supervisor, commands: dict[str, object]) -> Callable[[AdminRequest], Ok]:
    """The control server's handler: ``commands[name].execute(supervisor, args)``."""

    def handle(request: AdminRequest) -> Ok:
        mod = commands.get(request.command)
        if mod is None:
            raise UnknownCommandError(f"unknown command {request.command!r} "
                                      f"(known: {', '.join(sorted(commands))})")
        return Ok(request.id, mod.execute(supervisor, dict(request.args)))

    return handle


class SupervisorLoop:
    def __init__(self, supervisor, control: ControlServer, heartbeat_address: str, *,
                 reload_config: Callable[[], object] | None = None,
                 watchdog: Callable[[], bool] | None = None,
                 watchdog_interval_s: float | None = None,
                 ctx: zmq.Context | None = None,
                 frontend_liveness_address: str | None = None) -> None:
        self.supervisor = supervisor
        self.control = control
        self.reload_config = reload_config
        self.watchdog = watchdog
        self.watchdog_interval_s = watchdog_interval_s
        self.ctx = ctx or zmq.Context.instance()
        self.heartbeats = self.ctx.socket(zmq.PULL)
        self.heartbeats.setsockopt(zmq.LINGER, 0)
        self.heartbeats.setsockopt(zmq.MAXMSGSIZE, HEARTBEAT_MAX_BYTES)
        bind_private(self.heartbeats, heartbeat_address)
        self._wakeup_r, self._wakeup_w = socket.socketpair()
        self._wakeup_r.setblocking(False)
        self._wakeup_w.setblocking(False)
        self._signals: list[int] = []
        self._poller = zmq.Poller()
        self._poller.register(self.heartbeats, zmq.POLLIN)
        self._poller.register(self._wakeup_r.fileno(), zmq.POLLIN)
        self.frontend_beats = None  # the frontend's event loop answering (common/liveness.py)
        if frontend_liveness_address is not None:
            self.frontend_beats = self.ctx.socket(zmq.PULL)
            self.frontend_beats.setsockopt(zmq.LINGER, 0)
            self.frontend_beats.setsockopt(zmq.MAXMSGSIZE, HEARTBEAT_MAX_BYTES)
            bind_private(self.frontend_beats, frontend_liveness_address)
            self._poller.register(self.frontend_beats, zmq.POLLIN)
        for sock in control.sockets:
            self._poller.register(sock, zmq.POLLIN)
        self._children: dict[int, object] = {}  # pidfd -> child
        self._sentinels: dict[int, object] = {}  # thread pidfd (exit sentinel) -> child
        self.num_iterations = 0
        self.num_bad_heartbeats = 0  # dropped: undecodable, or their handling raised
        self.num_failed_events = 0  # a pidfd, wakeup or liveness handler that raised (logged, skipped)

    # -- signals ------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._wakeup_w.fileno(), warn_on_full_buffer=False)

    def _on_signal(self, signum, frame) -> None:
        self._signals.append(signum)  # handled on the loop, after poll returns

    def _handle_signals(self) -> None:
        pending, self._signals = self._signals, []
        for signum in pending:
            if signum == signal.SIGHUP:
                self._reload()
            elif self.supervisor.shutting_down:
                log.warning("second stop signal: killing every child now")
                self.supervisor.kill_all()
            else:
                log.info("stop signal", signal=signal.Signals(signum).name)
                self.supervisor.begin_shutdown()

    def _reload(self) -> None:
        if self.reload_config is None or self.supervisor.shutting_down:
            return
        try:
            new = self.reload_config()
        except Exception as exc:  # a bad edit of the file must not stop serving
            log.error("reload failed; keeping the running configuration", error=str(exc))
            self.supervisor.notifier.reloading(status=f"reload failed: {exc}")
            self.supervisor.notifier.ready(status=self.supervisor.status_line())
            return
        self.supervisor.reload(new)

    # -- the loop -----------------------------------------------------------------------
    def _sync_children(self) -> None:
        children = self.supervisor.live_children()
        live = {}
        for child in children:
            try:
                live[child.fileno()] = child
            except ValueError:  # reaped by an exit handler that then failed: nothing to wait for
                continue
        sentinels = {fd: child for child in children
                     for fd in (child.exit_sentinels() if hasattr(child, "exit_sentinels") else ())}
        for registered, wanted in ((self._children, live), (self._sentinels, sentinels)):
            for fd in list(registered):
                if fd not in wanted or wanted[fd] is not registered[fd]:
                    self._poller.unregister(fd)
                    del registered[fd]
            for fd, child in wanted.items():
                if fd not in registered:
                    self._poller.register(fd, zmq.POLLIN)
                    registered[fd] = child

    def _read_heartbeats(self) -> None:
        from planaria.engine.heartbeat import decode

        for _ in range(MAX_HEARTBEATS_PER_POLL):  # a flood must not starve the rest of the loop
            try:
                frame = self.heartbeats.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                beat = decode(frame)
            except msgspec.DecodeError as exc:
                self.num_bad_heartbeats += 1
                if should_log(self.num_bad_heartbeats):
                    log.warning("dropped an undecodable heartbeat", error=str(exc)[:200],
                                num_bytes=len(frame), num_bad=self.num_bad_heartbeats)
                continue
            try:
                self.supervisor.on_heartbeat(beat)
            except Exception:  # noqa: BLE001 - one heartbeat never ends the daemon
                self.num_bad_heartbeats += 1
                if should_log(self.num_bad_heartbeats):
                    log.warning("dropped a heartbeat whose handling failed", exc_info=True,
                                engine_id=beat.engine_index, pid=beat.pid,
                                num_bad=self.num_bad_heartbeats)

    def _drain_wakeup(self) -> None:
        """Empty the signal wakeup socket (its bytes are signal numbers; the handlers
        have queued the signals themselves)."""
        try:
            while self._wakeup_r.recv(512):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _guarded(self, what: str, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)``; an exception is logged (rate-limited) and the loop goes on."""
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - one event never ends the daemon and its children
            self.num_failed_events += 1
            if should_log(self.num_failed_events):
                log.warning("event handler failed; skipped", what=what, exc_info=True,
                            num_failed=self.num_failed_events)

    def run(self) -> int:
        sup = self.supervisor
        clock = sup.clock
        next_ping = clock()
        sup.open_kv_segments()  # before the first engine: it is named in their environment
        try:
            return self._run(sup, clock, next_ping)
        finally:
            sup.close_kv_segments()  # every child is gone (or, on a failure, about to be killed)

    def _run(self, sup, clock, next_ping: float) -> int:
        sup.start()
        next_due = sup.tick()
        while not sup.done:
            self._sync_children()
            now = clock()
            wake = [t for t in (next_due, next_ping if self.watchdog_interval_s else None)
                    if t is not None]
            timeout_ms = max(0, int((min(wake) - now) * 1000) + 1) if wake else 1000
            events = dict(self._poller.poll(timeout_ms))
            self.num_iterations += 1
            if self._wakeup_r.fileno() in events:
                self._guarded("signal wakeup", self._drain_wakeup)
            self._handle_signals()
            for child in {id(c): c for fd, c in self._sentinels.items() if fd in events}.values():
                # Level-triggered and final: stop watching (no busy poll until the reap).
                for fd in [fd for fd, c in self._sentinels.items() if c is child]:
                    self._poller.unregister(fd)
                    del self._sentinels[fd]
                self._guarded("exit sentinel", child.stop_watching_threads)
                self._guarded("exit sentinel", sup.on_exiting, child)
            for fd, child in list(self._children.items()):
                if fd in events:
                    self._guarded("child exit", sup.on_exit, child)
            if self.heartbeats in events:
                self._read_heartbeats()
            if self.frontend_beats is not None and self.frontend_beats in events:
                self._guarded("frontend liveness beat", self._take_frontend_beats)
            if any(sock in events for sock in self.control.sockets):
                self.control.poll_once(0)
            next_due = sup.tick()
            if self.watchdog_interval_s and clock() >= next_ping:
                self.watchdog()
                next_ping = clock() + self.watchdog_interval_s
        return sup.exit_code

    def _take_frontend_beats(self) -> None:
        from planaria.common import liveness

        for _ in range(MAX_HEARTBEATS_PER_POLL):
            try:
                frame = self.frontend_beats.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                beat = liveness.decode(frame.bytes)
            except msgspec.DecodeError as exc:
                self.num_bad_heartbeats += 1
                if should_log(self.num_bad_heartbeats):
                    log.warning("dropped an undecodable frontend liveness beat", error=str(exc)[:200],
                                num_bad=self.num_bad_heartbeats)
                continue
            pid = liveness.sender_pid(frame, beat)
            if pid is None:  # not from the process it names: it must not keep a frontend alive
                self.num_bad_heartbeats += 1
                if should_log(self.num_bad_heartbeats):
                    log.warning("refused a frontend liveness beat: its sender is not the pid it claims",
                                claimed_pid=beat.pid, peer=frame.get("Peer-Address"),
                                num_bad=self.num_bad_heartbeats)
                continue
            self.supervisor.on_frontend_beat(pid, beat.lag_s, beat.routing)

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        self.heartbeats.close(linger=0)
        if self.frontend_beats is not None:
            self.frontend_beats.close(linger=0)
        self._wakeup_r.close()
        self._wakeup_w.close()
