"""The systemd notify protocol, without libsystemd.

A notification is one AF_UNIX SOCK_DGRAM datagram of newline-separated ``KEY=value``
lines sent to ``$NOTIFY_SOCKET``; a leading ``@`` in that address means the Linux
abstract namespace (the ``@`` becomes a NUL byte). Without ``NOTIFY_SOCKET`` (not run
by systemd, or not ``Type=notify``) a ``Notifier`` is disabled and every call is a
no-op that returns False, so callers never need to check ``enabled`` first.

Under ``NotifyAccess=main`` only the supervisor's messages are accepted; children
should not inherit the variable: build the notifier with ``unset_environment=True``.

Usage::

    notifier = Notifier.from_environ(unset_environment=True)
    notifier.status("loading weights")
    notifier.ready()
    interval_s = watchdog_interval_s()       # None when the watchdog is off
    ... every interval_s: notifier.watchdog()
    notifier.stopping()
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, MutableMapping

_log = logging.getLogger(__name__)


def _socket_address(address: str) -> str | bytes:
    if address.startswith("@"):
        return b"\0" + address[1:].encode()
    return address


class Notifier:
    """Sends sd_notify datagrams to one address (``None``: disabled)."""

    def __init__(self, address: str | None = None) -> None:
        if address and not address.startswith(("/", "@")):
            # systemd also knows vsock: addresses (v254+); they are not supported here.
            _log.warning("unsupported NOTIFY_SOCKET %r; systemd notifications disabled",
                         address)
            address = None
        self.address = address or None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None, *,
                     unset_environment: bool = False) -> "Notifier":
        """A notifier for ``$NOTIFY_SOCKET``; ``unset_environment`` removes the variable
        (and the watchdog ones) so that child processes do not inherit them."""
        env = os.environ if environ is None else environ
        notifier = cls(env.get("NOTIFY_SOCKET"))
        if unset_environment:
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                env.pop(key, None)
        return notifier

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send ``KEY=value`` lines as one datagram; True when it was sent."""
        if self.address is None:
            return False
        payload = "\n".join(lines).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.setblocking(False)
                self._sock.sendto(payload, _socket_address(self.address))
            except OSError as exc:
                _log.warning("sd_notify to %s failed: %s", self.address, exc)
                return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Startup finished (``Type=notify`` units become active on this)."""
        return self.notify("READY=1", *([f"STATUS={status}"] if status is not None else []))

    def status(self, text: str) -> bool:
        """A one-line free-form status shown by ``systemctl status``."""
        return self.notify(f"STATUS={' '.join(text.splitlines())}")

    def watchdog(self) -> bool:
        """Keep-alive ping for ``WatchdogSec=``."""
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status is not None else []))

    def reloading(self, status: str | None = None) -> bool:
        """Reload started; send ``ready()`` when it is done. systemd (v253+) wants the
        CLOCK_MONOTONIC time in microseconds alongside."""
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        lines = ["RELOADING=1", f"MONOTONIC_USEC={monotonic_usec}"]
        return self.notify(*lines, *([f"STATUS={status}"] if status is not None else []))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for more time to start or stop (e.g. while loading weights)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def mainpid(self, pid: int) -> bool:
        return self.notify(f"MAINPID={int(pid)}")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> "Notifier":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def watchdog_interval_s(environ: Mapping[str, str] | None = None,
                        pid: int | None = None) -> float | None:
    """How often to call ``watchdog()``: half of ``$WATCHDOG_USEC``, or None when the
    watchdog is off, the value is not a positive integer, or ``$WATCHDOG_PID`` names
    another process (``pid`` defaults to this process)."""
    env = os.environ if environ is None else environ
    raw_usec = env.get("WATCHDOG_USEC")
    if not raw_usec:
        return None
    try:
        usec = int(raw_usec)
    except ValueError:
        _log.warning("ignoring WATCHDOG_USEC=%r: not an integer", raw_usec)
        return None
    if usec <= 0:
        return None
    raw_pid = env.get("WATCHDOG_PID")
    if raw_pid:
        try:
            watchdog_pid = int(raw_pid)
        except ValueError:
            _log.warning("ignoring WATCHDOG_PID=%r: not an integer", raw_pid)
            return None
        if watchdog_pid != (os.getpid() if pid is None else pid):
            return None
    return usec / 2 / 1_000_000
