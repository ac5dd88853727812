"""The embedded etcd as a supervised child: restarted with backoff, health-checked, shown.

``planaria serve --parallel ep`` without ``--etcd-endpoints`` runs its own etcd
(elastic/etcd_server.py). ``EtcdKeeper`` owns that process from one thread of its own:

- it starts etcd the secured way (elastic/etcd_bootstrap.py: auth on with the state
  directory's root credential and the users and roles audited at every start; an etcd
  ``exposed`` beyond loopback is set up on loopback first, at the keeper's first start and
  after a start that failed, then served over TLS), and waits for ``/health``;
- every ``check_interval_s`` it looks at the process (exited?) and every
  ``health_interval_s`` at ``/health``; a process that exited, or that has answered no
  health check for ``unhealthy_after_s`` (hung: SIGKILL by pid), is restarted on the SAME
  data directory and ports, after the restart policy's backoff (daemon/restart_policy.py:
  decide, then act), so the cluster's records, leases and revisions come back with it;
- the process is started with ``PR_SET_PDEATHSIG`` from this thread, which lives until
  :meth:`stop` (which stops etcd by pid, SIGTERM then SIGKILL, from the same thread), so a
  daemon killed outright takes its etcd with it;
- ``status()`` is what ``planaria status`` shows: state, pid, restarts, last exit.

Lifecycle (``EtcdState``):

    STARTING -> RUNNING -> (exited, or unhealthy too long: SIGKILL) -> BACKOFF -> STARTING
    STARTING -> (would not start) -> BACKOFF
    any -> STOPPED (``stop()``)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

import structlog

from planaria.daemon.children import describe_exit
from planaria.daemon.restart_policy import RestartAt, RestartNow, RestartPolicy
from planaria.elastic.errors import EtcdError, EtcdStartError
from planaria.elastic.etcd_bootstrap import start_secured
from planaria.elastic.etcd_server import EmbeddedEtcd

log = structlog.get_logger("planaria.etcd")
KEY = "etcd"


class EtcdState(str, Enum):
    """See the module docstring for the transitions."""

    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"
    STOPPED = "stopped"


def default_policy() -> RestartPolicy:
    """Quick first restarts (etcd's data is on disk: a restart is about a second), a flap
    hold that still retries every half minute, and no retry limit: EP needs etcd back."""
    return RestartPolicy(backoff_initial_s=0.5, backoff_max_s=10.0, flap_window_s=60.0, flap_max_exits=10,
                         flap_hold_s=30.0, stable_s=10.0)


class EtcdKeeper:
    def __init__(self, etcd: EmbeddedEtcd, *, password: str | None = None, exposed: bool = False,
                 policy: RestartPolicy | None = None,
                 check_interval_s: float = 0.25, health_interval_s: float = 1.0, unhealthy_after_s: float = 15.0,
                 start_timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.etcd = etcd
        self._password = password  # None: no auth (tests of the process handling alone)
        self.exposed = exposed  # listens beyond loopback: set up on loopback first (etcd_bootstrap)
        self._bootstrapped = False  # this keeper has set up and audited the data dir on loopback
        self.policy = policy or default_policy()
        self.check_interval_s, self.health_interval_s = check_interval_s, health_interval_s
        self.unhealthy_after_s, self.start_timeout_s = unhealthy_after_s, start_timeout_s
        self._clock = clock
        self.state = EtcdState.STOPPED
        self.pid: int | None = None
        self.started_at: float | None = None
        self.healthy_at: float | None = None
        self.reason = ""
        self.auth_enabled_at_start = False  # auth was turned on by the last start (a fresh data dir)
        self._due_at: float | None = None
        self._stopped = threading.Event()
        self._first = threading.Event()
        self._first_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return self.etcd.endpoint

    @property
    def restarts(self) -> int:
        return self.policy.restarts(KEY)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "EtcdKeeper":
        """Start the thread and wait for etcd's first start; EtcdStartError if it fails."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="etcd-keeper", daemon=True)
            self._thread.start()
        self._first.wait()
        if self._first_error is not None:
            self._thread.join(10)
            raise self._first_error
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop etcd by pid (SIGTERM, then SIGKILL) and the thread."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.etcd.running:  # the thread did not get to it
            self.etcd.stop()
        self.state = EtcdState.STOPPED

    def status(self) -> dict[str, Any]:
        now = self._clock()
        exits = self.policy.last_exits(KEY)
        return {"state": self.state.value, "pid": self.pid, "endpoint": self.endpoint,
                "restarts": self.restarts, "reason": self.reason,
                "uptime_s": round(now - self.started_at, 3) if self.started_at is not None else None,
                "last_exit": exits[-1][2] if exits else None,
                "restart_in_s": round(max(0.0, self._due_at - now), 3) if self._due_at is not None else None}

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._start_once()
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            self._first_error = exc
            self._first.set()
            self.etcd.stop()
            return
        self._first.set()
        next_health = self._clock() + self.health_interval_s
        try:
            while not self._stopped.wait(self.check_interval_s):
                now = self._clock()
                if self.state is EtcdState.RUNNING:
                    code = self.etcd.poll()
                    if code is not None:
                        self._exited(now, code, describe_exit(code))
                    elif now >= next_health:
                        next_health = now + self.health_interval_s
                        self._check_health(now)
                if self.state is EtcdState.BACKOFF:
                    self._maybe_restart(now)
        finally:
            self.etcd.stop()
            self.pid = None
            self.state = EtcdState.STOPPED

    def _check_health(self, now: float) -> None:
        if self.etcd.healthy(timeout_s=min(2.0, self.health_interval_s * 2)):
            self.healthy_at = now
            self.policy.record_healthy(KEY, now)
            return
        since = self.healthy_at if self.healthy_at is not None else (self.started_at or now)
        if now - since >= self.unhealthy_after_s:
            pid = self.pid
            log.error("etcd unhealthy; SIGKILL", pid=pid, unhealthy_s=round(now - since, 1))
            self.etcd.kill()
            self._exited(now, None, f"no healthy answer for {now - since:.0f}s; killed")

    def _exited(self, now: float, code: int | None, reason: str) -> None:
        log.error("etcd exited", pid=self.pid, reason=reason, restarts=self.restarts)
        self.policy.record_exit(KEY, now, code, reason)
        self.pid = None
        self.started_at = None
        self.state = EtcdState.BACKOFF
        self.reason = reason
        self._due_at = None  # the loop asks the policy on its next check

    def _maybe_restart(self, now: float) -> None:
        action = self.policy.decide(KEY, now)
        if isinstance(action, RestartNow):
            self._due_at = None
            try:
                self._start_once()
            except EtcdError as exc:
                self._exited(self._clock(), None, f"restart failed: {exc}")
        elif isinstance(action, RestartAt):
            self._due_at = action.t
        else:  # HoldOff (flapping); GiveUp cannot happen without a retry limit
            self._due_at = getattr(action, "until", None)
            self.reason = getattr(action, "reason", self.reason)

    def _start_once(self) -> None:
        self.state = EtcdState.STARTING
        now = self._clock()
        self.policy.record_start(KEY, now)
        try:
            if self._password is None:
                self.etcd.start(timeout_s=self.start_timeout_s)
            else:
                bootstrap = not self._bootstrapped
                self._bootstrapped = False  # until this start has succeeded
                self.auth_enabled_at_start = start_secured(self.etcd, self._password, exposed=self.exposed,
                                                           bootstrap=bootstrap, timeout_s=self.start_timeout_s)
                self._bootstrapped = True
            self.pid = self.etcd.pid
        except EtcdError:
            self.etcd.stop()
            self.pid = None
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. the port taken: a failed start like any other
            self.etcd.stop()
            self.pid = None
            raise EtcdStartError(f"etcd start failed: {exc}") from exc
        self.started_at = self.healthy_at = self._clock()
        self.state = EtcdState.RUNNING
        self.reason = ""
        log.info("etcd running", pid=self.pid, endpoint=self.etcd.endpoint, restarts=self.restarts,
                 auth_turned_on=self.auth_enabled_at_start)
