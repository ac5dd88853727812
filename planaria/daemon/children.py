"""Child processes of the supervisor: what to run (``ChildSpec``), and the real spawner.

The supervisor's logic sees children only through the ``Child`` surface (``pid``,
``poll()``, ``send_signal()``) and spawns them through a spawner's ``spawn(spec)``, so
tests hand it fakes. The real ones are built here, in one place:

- ``PopenSpawner`` starts ``subprocess.Popen`` children, each in a new session (its own
  process group, so a terminal's ^C or a group signal never reaches it by accident),
  with stdout and stderr appended to the child's log file, and with
  ``PR_SET_PDEATHSIG=SIGKILL`` so that a supervisor killed outright (SIGKILL, a
  watchdog abort) never leaves engines holding the GPU or the HTTP port.
- ``PopenChild.fileno()`` is a pidfd (``os.pidfd_open``): readable once the process has
  exited, so the supervisor waits on it with its poller, beside its sockets, and learns
  of a death without polling. Signals go to the pid, and only while it is not reaped.
- ``PopenChild.watch_threads(tids)`` adds thread pidfds (``PIDFD_THREAD``, Linux 6.9+) on
  threads that live as long as the process (an engine's exit sentinels,
  engine/heartbeat.py): they fire as soon as a killed process's threads are gone, before
  the kernel has freed its memory, so the supervisor can report the death early
  (``exit_sentinels()``); the process pidfd still decides when it is reaped.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Protocol

_PR_SET_PDEATHSIG = 1
PIDFD_THREAD = os.O_EXCL  # linux/pidfd.h: a pidfd for one thread, readable when it exits


@dataclass(frozen=True)
class ChildSpec:
    """How to start one child. ``key`` names its slot: ("frontend",) or ("engine", 3)."""

    key: Hashable
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict, repr=False)
    log_path: str | None = None
    cwd: str | None = None
    stdin_pipe: bool = False  # a pipe to the child's stdin (a warm standby's assignment), else /dev/null


class Child(Protocol):
    spec: ChildSpec
    pid: int

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> bool: ...


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl: do not outlive it
        os._exit(1)


class PopenChild:
    def __init__(self, spec: ChildSpec, popen: subprocess.Popen) -> None:
        self.spec = spec
        self.popen = popen
        self.pid = popen.pid
        self._pidfd: int | None = os.pidfd_open(popen.pid)
        self._thread_pidfds: list[int] = []
        self.watched_tids: list[int] = []

    def fileno(self) -> int:
        """A pidfd: poll it for POLLIN, which means the process has exited."""
        if self._pidfd is None:
            raise ValueError("the child was reaped")
        return self._pidfd

    def exit_sentinels(self) -> list[int]:
        """Thread pidfds: any one readable means the process is exiting."""
        return list(self._thread_pidfds)

    def watch_threads(self, tids: list[int]) -> int:
        """Open thread pidfds on ``tids`` (threads of this process only); returns how many
        are watched. Without kernel support (EINVAL) or for a tid that is gone, none."""
        if self._pidfd is None or self.watched_tids:
            return len(self._thread_pidfds)
        self.watched_tids = list(tids)
        for tid in tids:
            try:
                fd = os.pidfd_open(tid, PIDFD_THREAD)
            except (OSError, OverflowError, TypeError):  # the tids come from a heartbeat
                continue
            # Opened first, checked second: the tid cannot be reused while the pidfd is open.
            if os.path.exists(f"/proc/{self.pid}/task/{tid}"):
                self._thread_pidfds.append(fd)
            else:
                os.close(fd)
        return len(self._thread_pidfds)

    def stop_watching_threads(self) -> None:
        for fd in self._thread_pidfds:
            os.close(fd)
        self._thread_pidfds = []

    def poll(self) -> int | None:
        code = self.popen.poll()
        if code is not None and self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
            self.stop_watching_threads()
        return code

    def send_signal(self, sig: int) -> bool:
        """Signal the pid unless it was reaped already (then the pid may be reused)."""
        if self.popen.returncode is not None:
            return False
        try:
            self.popen.send_signal(sig)
        except ProcessLookupError:
            return False
        return True


def open_child_log(spec: ChildSpec, how: str = ""):
    """``spec``'s log file, opened for appending after a line saying what starts (and
    ``how``, e.g. in which process): the one header every child's log gets."""
    Path(spec.log_path).parent.mkdir(parents=True, exist_ok=True)
    log = open(spec.log_path, "ab")  # noqa: SIM115 - the caller closes it
    log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S%z')} planaria starts{how}: "
              f"{' '.join(spec.argv)}\n".encode())
    log.flush()
    return log


class PopenSpawner:
    def spawn(self, spec: ChildSpec) -> PopenChild:
        log = open_child_log(spec) if spec.log_path else None  # the child keeps its own copy
        try:
            popen = subprocess.Popen(
                spec.argv, env=spec.env or None, cwd=spec.cwd,
                stdin=subprocess.PIPE if spec.stdin_pipe else subprocess.DEVNULL,
                stdout=log if log else subprocess.DEVNULL, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent, close_fds=True)
        finally:
            if log is not None:
                log.close()
        return PopenChild(spec, popen)
