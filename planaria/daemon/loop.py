"""The supervisor's run loop: one zmq poller over everything that can wake it.

    child pidfds (exit), engines' thread pidfds (exiting)  |  heartbeat PULL  |  control ROUTER  |  signal wakeup fd
                         v
                  Supervisor.on_exit / on_exiting / on_heartbeat / admin execute / stop, reload
                         v
                  Supervisor.tick() -> next deadline -> poll timeout

No sleep-polling: the loop blocks in ``poll`` until an event or the next deadline (a
restart due, a SIGKILL due, the hang check, the watchdog ping). ``WATCHDOG=1`` is sent
from the loop itself, so a wedged or stopped loop stops the pings and systemd's
watchdog fires. Also here: ``DeathReporter``, the PUSH socket that tells the frontend
an engine died (ENGINE_CORE_DEAD on its PULL, as engine.wire describes).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Callable

import msgspec
import zmq

from planaria.common.envelope import AdminRequest, Ok
from planaria.common.errors import UnknownCommandError
from planaria.common.logging import get_logger
from planaria.daemon.control import ControlServer

log = get_logger("planaria.loop")


class DeathReporter:
    """Sends ENGINE_CORE_DEAD for an engine to the frontend's PULL socket. Never blocks:
    ``IMMEDIATE`` means no queueing for a frontend that is not connected (it would
    otherwise deliver stale deaths to the next frontend)."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        from planaria.engine.wire import WireEncoder

        self.address = address
        self._enc = WireEncoder(reuse_buffer=False)
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.SNDHWM, 64)
        self._sock.connect(address)

    def __call__(self, engine_id: int, pid: int | None, reason: str, cause: str = "",
                 suspects: list[str] | tuple = ()) -> bool:
        from planaria.engine.wire import EngineDead, MsgType

        frames = self._enc.encode(MsgType.ENGINE_CORE_DEAD,
                                  EngineDead(engine_index=engine_id, reason=reason, pid=pid,
                                             # when we saw it die: a frontend does not count
                                             # the death against requests sent after it
                                             fault_monotonic_s=time.monotonic(), cause=cause,
                                             suspects=list(suspects)))
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("frontend not connected; ENGINE_CORE_DEAD not delivered",
                        engine_id=engine_id, pid=pid)
            return False
        log.info("reported engine death to the frontend", engine_id=engine_id, pid=pid,
                 reason=reason, sent_at=time.time(), **({"cause": cause} if cause else {}),
                 **({"suspects": list(suspects)} if suspects else {}))
        return True

    def close(self) -> None:
        self._sock.close(linger=0)


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
                 ctx: zmq.Context | None = None) -> None:
        self.supervisor = supervisor
        self.control = control
        self.reload_config = reload_config
        self.watchdog = watchdog
        self.watchdog_interval_s = watchdog_interval_s
        self.ctx = ctx or zmq.Context.instance()
        self.heartbeats = self.ctx.socket(zmq.PULL)
        self.heartbeats.setsockopt(zmq.LINGER, 0)
        self.heartbeats.bind(heartbeat_address)
        self._wakeup_r, self._wakeup_w = socket.socketpair()
        self._wakeup_r.setblocking(False)
        self._wakeup_w.setblocking(False)
        self._signals: list[int] = []
        self._poller = zmq.Poller()
        self._poller.register(self.heartbeats, zmq.POLLIN)
        self._poller.register(self._wakeup_r.fileno(), zmq.POLLIN)
        for sock in control.sockets:
            self._poller.register(sock, zmq.POLLIN)
        self._children: dict[int, object] = {}  # pidfd -> child
        self._sentinels: dict[int, object] = {}  # thread pidfd (exit sentinel) -> child
        self.num_iterations = 0

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
        live = {child.fileno(): child for child in children}
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

    def run(self) -> int:
        from planaria.engine.heartbeat import decode

        sup = self.supervisor
        clock = sup.clock
        next_ping = clock()
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
                try:
                    while self._wakeup_r.recv(512):
                        pass
                except BlockingIOError:
                    pass
            self._handle_signals()
            for child in {id(c): c for fd, c in self._sentinels.items() if fd in events}.values():
                # Level-triggered and final: stop watching (no busy poll until the reap).
                for fd in [fd for fd, c in self._sentinels.items() if c is child]:
                    self._poller.unregister(fd)
                    del self._sentinels[fd]
                child.stop_watching_threads()
                sup.on_exiting(child)
            for fd, child in list(self._children.items()):
                if fd in events:
                    sup.on_exit(child)
            if self.heartbeats in events:
                for _ in range(1000):
                    try:
                        frame = self.heartbeats.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        sup.on_heartbeat(decode(frame))
                    except msgspec.DecodeError as exc:
                        log.warning("bad heartbeat", error=str(exc))
            if any(sock in events for sock in self.control.sockets):
                self.control.poll_once(0)
            next_due = sup.tick()
            if self.watchdog_interval_s and clock() >= next_ping:
                self.watchdog()
                next_ping = clock() + self.watchdog_interval_s
        return sup.exit_code

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        self.heartbeats.close(linger=0)
        self._wakeup_r.close()
        self._wakeup_w.close()
