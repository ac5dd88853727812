"""A real `planaria serve` on loopback, for chaos tests and the fault-recovery bench.

    stack = ServeStack(root, num_engines=2, hang_timeout_s=1.0)
    stack.start()                       # the daemon, its frontend and engines, all serving
    fault = stack.fault(0, "kill")      # or "hang" (SIGSTOP), "fatal" (a step raises)
    exited = stack.wait_exit(fault)     # the supervisor's own "exited" log event
    stack.close()

Everything here is the shipped daemon: ``python -m planaria.daemon.cli serve`` (the supervisor:
pidfd sentinels, restart policy, ENGINE_CORE_DEAD reports to the frontend, hang kill
from heartbeats) spawns ``python -m planaria.frontend.main`` and the engine cores. The harness
only adds what a test needs to cause and observe faults:

- ``PLANARIA_FAULT_INJECTION=1`` in the daemon's environment (children inherit it), and
  an ``EngineClient`` of its own (client index 1, ``fe1-in``), which every engine also
  handshakes with (``--extra-client-addresses``); it makes the ``fault_inject`` utility
  call for "fatal": the engine's next model step raises, the engine reports its own
  death and exits 1;
- "kill" is SIGKILL and "hang" SIGSTOP, to the pid the supervisor's status names; a
  SIGSTOPped engine is left to the supervisor's watchdog, which must kill it;
- reading the supervisor's JSON log (``PLANARIA_LOG_FORMAT=json``, its stdout in
  ``ROOT/serve.log``), the frontend's /ready and /metrics, and ``planaria status`` over
  the control socket.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import msgspec

from planaria.common.sockets import ipc_addresses

REPO = Path(__file__).resolve().parents[1]
ENGINE_CONFIG = dict(kv_cache_bytes=16 * 2**20, max_model_len=256, max_num_seqs=64,
                     max_num_batched_tokens=1024, num_threads=1)
FAULT_KINDS = ("kill", "hang", "fatal")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Fault:
    kind: str
    engine_id: int
    pid: int
    at: float  # time.time() just before the fault was caused


class _Loop:
    """An asyncio loop on a thread (the fault-injection EngineClient lives there)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="inject-loop")
        self.thread.start()

    def run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class ServeStack:
    def __init__(self, root: str | os.PathLike, num_engines: int = 2, hang_timeout_s: float = 1.0,
                 engine_config: dict | None = None, model: str | None = None,
                 serve_args: tuple[str, ...] = (), threads: int | None = 1,
                 env: dict[str, str] | None = None) -> None:
        """``threads``: OMP_NUM_THREADS of every process (None: torch's default, as `make
        serve` runs); ``env``: more environment for the daemon and its children."""
        from planaria.engine.demo_model import build_demo_model

        self.root = Path(root)
        self.num_engines = num_engines
        self.hang_timeout_s = hang_timeout_s
        self.model = Path(model) if model else self.root / "tiny-moe"
        if not (self.model / "config.json").exists():
            build_demo_model(self.model, "tiny-moe", progress=lambda _: None)
        self.engine_config = engine_config or ENGINE_CONFIG
        self.serve_args = serve_args
        self.state = self.root / "state"
        self.runtime = Path(tempfile.mkdtemp(prefix="pl-chaos-"))  # ipc paths stay short
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = self.root / "serve.log"
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                        HF_HUB_OFFLINE="1", PLANARIA_FAULT_INJECTION="1", PLANARIA_LOG_FORMAT="json",
                        **(env or {}))
        if threads is not None:
            self.env["OMP_NUM_THREADS"] = str(threads)
        self.proc: subprocess.Popen | None = None
        self.injector = None
        self._loop: _Loop | None = None
        self._seen_pids: set[int] = set()

    # -- lifecycle ------------------------------------------------------------------------
    def command(self) -> list[str]:
        heartbeat_s = self.hang_timeout_s / 4
        return [sys.executable, "-m", "planaria.daemon.cli", "serve", "--model", str(self.model),
                "--engines", str(self.num_engines), "--max-engines", str(self.num_engines),
                "--http", f"127.0.0.1:{self.port}", "--state-dir", str(self.state),
                "--runtime-dir", str(self.runtime),
                "--engine-config-json", msgspec.json.encode(self.engine_config).decode(),
                "--hang-timeout-s", f"{self.hang_timeout_s:g}", "--heartbeat-interval-s", f"{heartbeat_s:g}",
                # restart at once and never hold off: every fault here is deliberate
                "--restart-backoff-s", "0.05", "--restart-backoff-max-s", "0.5", "--stable-s", "1",
                "--flap-max-exits", "1000", "--stop-timeout-s", "10",
                "--extra-client-addresses", ipc_addresses(self.runtime, 1)[0], *self.serve_args]

    def start(self, timeout_s: float = 120.0) -> None:
        from planaria.engine.client import EngineClient

        self._loop = _Loop()
        self.injector = EngineClient(self.num_engines, self.runtime, client_index=1)

        async def start_injector():
            await self.injector.start(wait_ready=False)
        self._loop.run(start_injector())
        self.proc = subprocess.Popen(self.command(), cwd=REPO, env=self.env,
                                     stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        self.wait_ready(timeout_s)

    def close(self) -> None:
        """SIGCONT whatever a test left stopped, SIGTERM the daemon (it drains and stops
        its children), then SIGKILL by pid anything still there."""
        import psutil

        children = []
        if self.proc is not None:
            try:
                children = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            for pid in [c.pid for c in children] + list(self._seen_pids):
                try:
                    os.kill(pid, signal.SIGCONT)
                except (ProcessLookupError, PermissionError):
                    pass
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
            for child in children:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
        if self._loop is not None:
            try:
                self._loop.run(self.injector.close(), 10)
            finally:
                self._loop.close()
        shutil.rmtree(self.runtime, ignore_errors=True)

    def logs(self, num_chars: int = 3000) -> str:
        parts = [f"--- serve\n{self._read(self.log_path)[-2 * num_chars:]}"]
        for p in sorted((self.state / "logs").glob("*.log")):
            parts.append(f"--- {p.name}\n{self._read(p)[-num_chars:]}")
        return "\n".join(parts)

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- what the daemon says -------------------------------------------------------------
    def status(self, timeout_s: float = 10.0) -> dict:
        from planaria.daemon.control import ControlClient

        return ControlClient(self.runtime, timeout_s=timeout_s).call("status")

    def events(self, event: str | None = None) -> list[dict]:
        """The supervisor's JSON log lines (optionally only those whose event is ``event``)."""
        out = []
        for line in self._read(self.log_path).splitlines():
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if event is None or record.get("event") == event:
                out.append(record)
        return out

    def ready_info(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"{self.base}/ready", timeout=2) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read() or b"null")
        except OSError:
            return None

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(\w+(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def serving_pids(self) -> dict[int, int] | None:
        """engine id -> pid when the supervisor, the frontend and the injector all see every
        engine running as the same process; None otherwise."""
        from planaria.common.errors import NotRunningError

        if self.proc.poll() is not None:
            raise RuntimeError(f"planaria serve exited with {self.proc.returncode}\n{self.logs()}")
        try:
            status = self.status()
        except NotRunningError:
            return None  # not bound yet
        pids = {e["engine_id"]: e["pid"] for e in status["engines"] if e["state"] == "running"}
        if len(pids) != self.num_engines or status["frontend"]["state"] != "running":
            return None
        info = self.ready_info()
        if not info or {e["index"]: e["pid"] for e in info["engines"] if e["state"] == "running"} != pids:
            return None
        if {e.index: e.pid for e in self.injector.engines if e.healthy} != pids:
            return None
        self._seen_pids.update(pids.values())
        return pids

    def wait_ready(self, timeout_s: float = 120.0) -> dict[int, int]:
        """Until every engine serves (see ``serving_pids``); returns engine id -> pid."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = self.serving_pids()
            if pids is not None:
                return pids
            time.sleep(0.05)
        raise TimeoutError(f"engines not all serving within {timeout_s} s\n{self.logs()}")

    def wait_busy(self, engine_id: int, timeout_s: float = 30.0) -> bool:
        """Until engine ``engine_id`` reports requests running in a heartbeat sent after this
        call (its step_counter moved: the last heartbeat may count requests since finished),
        so a fault caused next hits work in flight; False when it had none within ``timeout_s``."""
        def current() -> dict | None:
            return next((e for e in self.status()["engines"] if e["engine_id"] == engine_id), None)

        first = current()
        seen = ((first or {}).get("pid"), (first or {}).get("step_counter") or 0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            e = current()
            if e is not None and e["state"] == "running" and (e.get("num_running") or 0) > 0 \
                    and (e.get("pid"), e.get("step_counter") or 0) != seen:
                return True
            time.sleep(0.02)
        return False

    # -- faults ---------------------------------------------------------------------------
    def fault(self, engine_id: int, kind: str) -> Fault:
        """Cause ``kind`` in the engine now serving as ``engine_id``."""
        pid = next(e["pid"] for e in self.status()["engines"] if e["engine_id"] == engine_id)
        at = time.time()
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
        elif kind == "hang":
            os.kill(pid, signal.SIGSTOP)  # the supervisor's watchdog has to notice and kill it
        elif kind == "fatal":
            self._loop.run(self.injector.call_utility(engine_id, "fault_inject", {"kind": "fatal"}), 10)
        else:
            raise ValueError(f"unknown fault kind {kind!r} (known: {', '.join(FAULT_KINDS)})")
        return Fault(kind, engine_id, pid, at)

    def exit_event(self, pid: int) -> dict | None:
        """The supervisor's "exited" event for engine process ``pid``, once it logged it."""
        return next((e for e in self.events("exited") if e.get("pid") == pid
                     and e.get("engine_id") is not None), None)

    def wait_exit(self, fault: Fault, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            event = self.exit_event(fault.pid)
            if event is not None:
                return event
            time.sleep(0.02)
        raise TimeoutError(f"{fault}: the supervisor logged no exit within {timeout_s} s\n{self.logs()}")

    @staticmethod
    def exit_matches(kind: str, reason: str) -> bool:
        """Whether the supervisor's exit reason is the one ``kind`` should cause."""
        if kind == "kill":
            return reason == "killed by SIGKILL"
        if kind == "hang":
            return reason.startswith(("hung: work queued", "frozen: no heartbeat", "frozen: stopped (SIGSTOP)"))
        if kind == "fatal":
            return reason == "exit code 1"
        raise ValueError(kind)
