"""Boot a real systemd in a throwaway container, for tests of units and sd_notify.

Not a test module: a harness that tests import. The container is the host's own root
under ``systemd-nspawn --volatile=yes`` (a tmpfs root with the host's /usr read-only),
with a directory of unit files bound over /etc/systemd/system, so nothing of the host
is changed and the boot is short (only the units systemd ships plus the given ones)::

    with NspawnSystem(unit_dir, binds_ro=[(repo, repo)]) as system:   # boots
        system.systemctl("start", "x.service")
        system.show("x.service", "ActiveState", "StatusText")

Commands run inside through ``nsenter -t <container PID 1> -a`` (with ``--register=no``
there is no machined registration, so ``systemd-run --machine``/``machinectl shell`` do
not work). Stopping is ``systemctl poweroff`` inside, then SIGTERM, then SIGKILL to the
nspawn process, by its pid. Needs root, ``systemd-nspawn`` (Debian: systemd-container)
and ``nsenter`` (util-linux); ``unavailable_reason()`` says why not, for a skip.

Boot path verified here (Debian bookworm, systemd 252): `systemctl is-system-running
--wait` answers "running" a few seconds after the nspawn process starts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Iterable, Sequence

import psutil


def unavailable_reason() -> str | None:
    """Why a container cannot be booted here, or None when it can."""
    if os.geteuid() != 0:
        return "systemd-nspawn needs root"
    for tool in ("systemd-nspawn", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install systemd-container util-linux)"
    return None


class NspawnError(RuntimeError):
    """The container did not boot, or a command in it failed."""


class NspawnSystem:
    def __init__(self, unit_dir: str | os.PathLike, *,
                 binds_ro: Iterable[tuple[str | os.PathLike, str | os.PathLike]] = (),
                 log_path: str | os.PathLike | None = None,
                 machine: str | None = None) -> None:
        self.unit_dir = Path(unit_dir)
        self.binds_ro = [(Path(host), Path(inside)) for host, inside in binds_ro]
        self.machine = machine or f"planaria-test-{uuid.uuid4().hex[:8]}"
        self.log_path = Path(log_path) if log_path else self.unit_dir.parent / f"{self.machine}.log"
        self.boot_s: float | None = None
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._leader_pid: int | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def command(self) -> list[str]:
        cmd = ["systemd-nspawn", "--quiet", "--volatile=yes", "--register=no", "--keep-unit",
               f"--machine={self.machine}", "-D", "/",
               f"--bind-ro={self.unit_dir}:/etc/systemd/system"]
        cmd += [f"--bind-ro={host}:{inside}" for host, inside in self.binds_ro]
        # Without systemd.firstboot=off the boot stops at the first-boot wizard.
        return cmd + ["-b", "systemd.firstboot=off"]

    def boot(self, timeout_s: float = 60.0) -> float:
        """Start the container and wait until its systemd finished booting; returns the
        seconds that took (also kept in ``boot_s``)."""
        if self._proc is not None:
            raise NspawnError("already booted")
        started = time.monotonic()
        deadline = started + timeout_s
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                      stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        try:
            self._leader_pid = self._wait_leader(deadline)
            self._wait_booted(deadline)
        except BaseException:
            self.stop()
            raise
        self.boot_s = time.monotonic() - started
        return self.boot_s

    def _wait_leader(self, deadline: float) -> int:
        nspawn = psutil.Process(self._proc.pid)
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NspawnError(f"systemd-nspawn exited with {self._proc.returncode}: "
                                  f"{self.log_tail()}")
            for child in nspawn.children():
                try:
                    if Path(child.exe()).name == "systemd":
                        return child.pid
                except psutil.Error:
                    continue
            time.sleep(0.05)
        raise NspawnError(f"no systemd in the container before the deadline: {self.log_tail()}")

    def _wait_booted(self, deadline: float) -> None:
        last = ""
        while time.monotonic() < deadline:
            remaining = max(1.0, deadline - time.monotonic())
            try:
                result = self.run(["systemctl", "is-system-running", "--wait"],
                                  timeout_s=remaining)
            except subprocess.TimeoutExpired:
                break
            last = (result.stdout + result.stderr).strip()
            if result.stdout.strip() in ("running", "degraded"):
                return
            if self._proc.poll() is not None:
                break
            time.sleep(0.1)  # systemd's bus is not up yet
        raise NspawnError(f"container did not finish booting ({last!r}): {self.log_tail()}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """Power the container off; SIGTERM, then SIGKILL the nspawn process if needed."""
        proc, self._proc = self._proc, None
        if proc is not None:
            signals: list[signal.Signals | None] = [signal.SIGTERM, signal.SIGKILL]
            if proc.poll() is None and self._leader_pid is not None:
                try:
                    self._nsenter(["systemctl", "--no-block", "poweroff"], timeout_s=5.0)
                    signals.insert(0, None)  # first just wait for the poweroff
                except subprocess.TimeoutExpired:
                    pass
            for sig in signals:
                if sig is not None and proc.poll() is None:
                    os.kill(proc.pid, sig)
                try:
                    proc.wait(timeout=timeout_s / 2 if sig is None else 5.0)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._leader_pid = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "NspawnSystem":
        if self._proc is None:
            self.boot()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- inside the container -----------------------------------------------------------

    def run(self, cmd: Sequence[str], timeout_s: float = 30.0,
            check: bool = False) -> subprocess.CompletedProcess:
        """Run ``cmd`` in all of the container's namespaces; text output captured."""
        if self._leader_pid is None:
            raise NspawnError("the container is not running")
        result = self._nsenter(cmd, timeout_s)
        if check and result.returncode != 0:
            raise NspawnError(f"{' '.join(cmd)} exited with {result.returncode}: "
                              f"{result.stdout}{result.stderr}")
        return result

    def _nsenter(self, cmd: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess:
        return subprocess.run(["nsenter", "-t", str(self._leader_pid), "-a", "--", *cmd],
                              capture_output=True, text=True, timeout=timeout_s)

    def open_paths(self, paths: Iterable[str | os.PathLike]) -> None:
        """Make every directory above ``paths`` searchable by any user (``chmod o+x``), so
        that a unit with an unprivileged user reaches what is bound in. Only directories of
        the container's own volatile root change: a chmod on a read-only bind fails, and
        is left so."""
        parents = {parent for path in paths for parent in Path(path).parents if parent != Path("/")}
        for parent in sorted(parents):
            self.run(["chmod", "o+x", str(parent)])

    def systemctl(self, *args: str, timeout_s: float = 30.0,
                  check: bool = False) -> subprocess.CompletedProcess:
        return self.run(["systemctl", *args], timeout_s=timeout_s, check=check)

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        """``systemctl show -p ...`` as a dict."""
        args = [f"--property={p}" for p in properties]
        out = self.systemctl("show", *args, unit, check=True).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str, lines: int = 50) -> str:
        return self.run(["journalctl", "--no-pager", "-n", str(lines), "-u", unit]).stdout

    def log_tail(self, num_bytes: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""
