"""A real frontend process and its engine-core processes on a free loopback port, for the
HTTP tests: ``Stack(root, model, num_engines, engine_config)``; ``stop()`` ends each
process by pid and returns the frontend's exit code. ``serving(...)`` is the same as a
context (ready on entry; on exit the frontend must end cleanly on SIGTERM), ``run_async``
runs a test's coroutine with a time limit, ``openai_client`` points the official client
at a stack."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_proc(proc: subprocess.Popen, timeout_s: float = 15.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
    return proc.returncode


class Stack:
    def __init__(self, root: Path, model: Path, num_engines: int, engine_config: dict,
                 frontend_args: list[str] | tuple[str, ...] = (), frontend_env: dict[str, str] | None = None) -> None:
        self.model = model
        self.num_engines = num_engines
        # ipc paths must stay short (sun_path): a fresh short dir, not the pytest tmp path
        self.runtime = Path(tempfile.mkdtemp(prefix="pl-fe-"))
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.logs = root
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        self.frontend = subprocess.Popen(
            [sys.executable, "-m", "planaria.frontend.main", "--model", str(model), "--http", f"127.0.0.1:{self.port}",
             "--runtime-dir", str(self.runtime), "--engines", str(num_engines), "--drain-timeout-s", "5",
             "--engine-config-json", msgspec.json.encode(engine_config).decode(), *frontend_args],
            cwd=REPO, env={**env, **(frontend_env or {})}, stdout=open(root / "frontend.log", "wb"),
            stderr=subprocess.STDOUT)
        settings = msgspec.json.encode({"handshake_timeout_s": 60.0, "stats_interval_s": 0.2}).decode()
        self.engines = [subprocess.Popen(
            [sys.executable, "-m", "planaria.engine.proc", "--engine-index", str(i),
             "--input-addr", f"ipc://{self.runtime / 'fe0-in'}", "--settings-json", settings],
            cwd=REPO, env=env, stdout=open(root / f"engine{i}.log", "wb"), stderr=subprocess.STDOUT)
            for i in range(num_engines)]

    def log(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.logs.glob("*.log"))

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in [self.frontend, *self.engines]:
                if p.poll() is not None:
                    raise RuntimeError(f"pid {p.pid} exited with {p.returncode}\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.base}/ready", timeout=2) as r:
                    if r.status == 200 and f'"num_healthy_engines": {self.num_engines}' in r.read().decode():
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"not ready in {timeout_s} s\n{self.log()}")

    def stop(self) -> int:
        code = stop_proc(self.frontend)
        for e in self.engines:
            stop_proc(e)
        shutil.rmtree(self.runtime, ignore_errors=True)
        return code


@contextlib.contextmanager
def serving(root: Path, model: Path | str, num_engines: int, engine_config: dict, **kw):
    """A ready Stack; on exit every process is stopped and the frontend must have exited 0."""
    s = Stack(root, Path(model), num_engines, engine_config, **kw)
    try:
        s.wait_ready()
        yield s
    finally:
        code = s.stop()
        assert code == 0, f"frontend exited {code} on SIGTERM\n{s.log()}"


def run_async(coro, timeout_s: float):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def openai_client(stack: Stack, timeout_s: float = 60.0):
    import openai

    return openai.AsyncOpenAI(base_url=f"{stack.base}/v1", api_key="none", max_retries=0, timeout=timeout_s)


def _gauge_sum(text: str, name: str) -> int:
    return sum(int(float(v)) for v in re.findall(rf'^{name}\{{engine="\d+"\}} (\S+)$', text, re.M))


def prefill_tokens(stack: Stack, timeout_s: float = 30.0) -> int:
    """The engines' prompt tokens computed so far, summed (the /metrics gauge), read once
    no engine has a request running or waiting: the figure rides on the outputs, so by
    then it holds every step taken (earlier tests' aborted requests included)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{stack.base}/metrics", timeout=10) as r:
            text = r.read().decode()
        if _gauge_sum(text, "planaria_num_requests_running") + _gauge_sum(text, "planaria_num_requests_waiting") == 0:
            return _gauge_sum(text, "planaria_engine_prefill_tokens")
        assert time.monotonic() < deadline, f"engines still busy after {timeout_s} s:\n{text}"
        time.sleep(0.05)
