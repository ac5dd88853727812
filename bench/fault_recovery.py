"""Fault recovery: SIGKILL an engine under load, time each stage of the recovery.

    .venv/bin/python -m bench.fault_recovery [--trials 20] [--engines 2] [--streams 8]

Stack: the frontend (``python -m frontend.main``, HTTP on a free loopback port), N engine
processes on the tiny-moe demo model, and ``Cluster``'s stand-in supervisor: one thread
per engine blocked in ``waitpid`` (a process sentinel), which on an exit pushes
ENGINE_CORE_DEAD (with the dead pid) to the frontend's PULL socket over a PUSH socket it
connected in advance, then respawns the engine. (When ``daemon/supervisor.py`` lands,
``planaria serve`` does this itself; the frontend side is the same.) A second
``EngineClient`` (client_index 1, every engine connects to it too) is the control channel
for ``fault_inject`` utility calls.

Per trial: wait until every engine is running and ``--streams`` greedy streams are
producing tokens, SIGKILL engine ``trial % N`` and take ``time.time()``; then read from the
frontend's /metrics the wall-clock timestamps the frontend process itself took:

- notice:  ``planaria_engine_last_death_timestamp_seconds{engine}``, set by the
  EngineClient when it processes ENGINE_CORE_DEAD (engine/client.py ``mark_engine_dead``)
- replay:  ``planaria_replay_last_start_timestamp_seconds``, the last of the lost requests
  resubmitted to a survivor (so: every lost request replayed)
- token:   ``planaria_replay_last_first_token_timestamp_seconds``, the last of those
  replays' first token back in the frontend
- serving: ``planaria_engine_last_ready_timestamp_seconds{engine}``, the restarted
  engine's READY (weights loaded, KV allocated)

and prints p50 / p99 / max of each, measured from the kill. Every stream's text is
checked against a fault-free run of the same request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import msgspec
import zmq

REPO = Path(__file__).resolve().parents[1]
ENGINE_CONFIG = dict(kv_cache_bytes=16 * 2**20, max_model_len=256, max_num_seqs=64,
                     max_num_batched_tokens=1024, num_threads=1)
FAULT_KINDS = ("kill", "hang", "fatal")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Loop:
    """An asyncio loop on a thread (the control EngineClient lives there)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="control-loop")
        self.thread.start()

    def run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Cluster:
    """Frontend + ``num_engines`` engines + a stand-in supervisor (see the module doc).

    ``fault(index, kind)``: "kill" (SIGKILL), "hang" (SIGSTOP; after ``hang_timeout_s`` the
    stand-in hang detector SIGKILLs it), "fatal" (fault_inject: the next step raises; the
    engine reports its own death and exits 1). Returns the ``time.time()`` of the fault.
    """

    def __init__(self, root: Path, num_engines: int = 2, hang_timeout_s: float = 1.0,
                 restart_delay_s: float = 0.0, engine_config: dict | None = None) -> None:
        from engine.demo_model import build_demo_model

        self.root = Path(root)
        self.num_engines = num_engines
        self.hang_timeout_s = hang_timeout_s
        self.restart_delay_s = restart_delay_s
        self.model = self.root / "tiny-moe"
        if not (self.model / "config.json").exists():
            build_demo_model(self.model, "tiny-moe", progress=lambda _: None)
        self.config = {"model": str(self.model), **(engine_config or ENGINE_CONFIG)}
        self.runtime = Path(tempfile.mkdtemp(prefix="pl-chaos-"))  # ipc paths stay short
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                        OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PLANARIA_FAULT_INJECTION="1")
        self.procs: list[subprocess.Popen | None] = [None] * num_engines
        self.num_spawns = [0] * num_engines
        self.exits: list[tuple[int, float, int]] = []  # (index, time.time() reaped, exit code)
        self._lock = threading.Lock()
        self._closing = False
        self._watchers: list[threading.Thread] = []
        self._zmq = zmq.Context()
        self.frontend: subprocess.Popen | None = None
        self.control = None
        self._loop: _Loop | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> None:
        from engine.client import EngineClient

        self.frontend = subprocess.Popen(
            [sys.executable, "-m", "frontend.main", "--model", str(self.model),
             "--http", f"127.0.0.1:{self.port}", "--runtime-dir", str(self.runtime),
             "--engines", str(self.num_engines), "--drain-timeout-s", "5", "--log-level", "WARNING",
             "--engine-config-json", msgspec.json.encode(self.config).decode()],
            cwd=REPO, env=self.env, stdout=open(self.root / "frontend.log", "ab"), stderr=subprocess.STDOUT)
        self._loop = _Loop()
        self.control = EngineClient(self.num_engines, self.runtime, client_index=1)

        async def start_control():
            await self.control.start(wait_ready=False)
        self._loop.run(start_control())
        deadline = time.monotonic() + 10
        while not (self.runtime / "fe0-out").exists():  # the frontend's PULL must be bound
            if time.monotonic() > deadline or self.frontend.poll() is not None:
                raise RuntimeError(f"frontend did not bind its sockets\n{self.logs()}")
            time.sleep(0.05)
        for i in range(self.num_engines):
            self.procs[i] = self._spawn(i)
            t = threading.Thread(target=self._watch, args=(i,), daemon=True, name=f"watch-engine{i}")
            t.start()
            self._watchers.append(t)
        self.wait_ready(timeout_s)

    def close(self) -> None:
        self._closing = True
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
        if self.frontend is not None and self.frontend.poll() is None:
            self.frontend.send_signal(signal.SIGTERM)
        for p in [*self.procs, self.frontend]:
            if p is None:
                continue
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self._loop is not None:
            try:
                self._loop.run(self.control.close(), 10)
            finally:
                self._loop.close()
        self._zmq.term()
        shutil.rmtree(self.runtime, ignore_errors=True)

    def logs(self, num_chars: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-num_chars:]}"
                         for p in sorted(self.root.glob("*.log")))

    # -- the stand-in supervisor -----------------------------------------------------------
    def _spawn(self, index: int) -> subprocess.Popen:
        settings = {"handshake_timeout_s": 60.0, "stats_interval_s": 0.2, "linger_ms": 500}
        cmd = [sys.executable, "-m", "engine.proc", "--engine-index", str(index),
               "--input-addr", f"ipc://{self.runtime / 'fe0-in'}",
               "--input-addr", f"ipc://{self.runtime / 'fe1-in'}",
               "--config-json", msgspec.json.encode(self.config).decode(),
               "--settings-json", msgspec.json.encode(settings).decode()]
        self.num_spawns[index] += 1
        return subprocess.Popen(cmd, cwd=REPO, env=self.env, stderr=subprocess.STDOUT,
                                stdout=open(self.root / f"engine{index}.log", "ab"))

    def _watch(self, index: int) -> None:
        from engine.wire import EngineDead, MsgType, WireEncoder

        enc = WireEncoder(reuse_buffer=False)
        pushes = []
        for name in ("fe0-out", "fe1-out"):
            s = self._zmq.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{self.runtime / name}")
            pushes.append(s)
        try:
            while True:
                proc = self.procs[index]
                code = proc.wait()
                reaped = time.time()
                if self._closing:
                    return
                with self._lock:
                    self.exits.append((index, reaped, code))
                frames = enc.encode(MsgType.ENGINE_CORE_DEAD, EngineDead(
                    engine_index=index, reason=f"exited with code {code} (reported by the supervisor)",
                    pid=proc.pid))
                for s in pushes:
                    s.send_multipart(frames)
                if self.restart_delay_s:
                    time.sleep(self.restart_delay_s)
                if self._closing:
                    return
                self.procs[index] = self._spawn(index)
        finally:
            for s in pushes:
                s.close(0)

    def fault(self, index: int, kind: str) -> float:
        proc = self.procs[index]
        t = time.time()
        if kind == "kill":
            os.kill(proc.pid, signal.SIGKILL)
        elif kind == "hang":
            os.kill(proc.pid, signal.SIGSTOP)

            def detect() -> None:  # the supervisor's hang detector: no progress, kill it
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
            threading.Timer(self.hang_timeout_s, detect).start()
        elif kind == "fatal":
            self._loop.run(self.control.call_utility(index, "fault_inject", {"kind": "fatal"}), 10)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        return t

    # -- the frontend's view ---------------------------------------------------------------
    def ready_info(self) -> dict | None:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.base}/ready", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the frontend (and the control client) see every engine running."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.frontend.poll() is not None:
                raise RuntimeError(f"the frontend exited with {self.frontend.returncode}\n{self.logs()}")
            info = self.ready_info()
            control_ok = sum(e.healthy for e in self.control.engines) == self.num_engines
            if info and info.get("num_healthy_engines") == self.num_engines and control_ok:
                return
            time.sleep(0.05)
        raise TimeoutError(f"engines not all running within {timeout_s} s\n{self.logs()}")

    def metrics(self) -> dict[str, float]:
        import urllib.request

        with urllib.request.urlopen(f"{self.base}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(\w+(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out


# -- load ------------------------------------------------------------------------------
async def stream_completion(session: aiohttp.ClientSession, base: str, body: dict,
                            first_text: asyncio.Event | None = None) -> dict:
    """One streaming completion; returns {"text", "finish_reason", "error", "status"}.
    ``first_text`` is set when its first text arrives."""
    text, finish, error = [], None, None
    async with session.post(f"{base}/v1/completions", json={**body, "stream": True}) as r:
        if r.status != 200:
            return {"text": "", "finish_reason": None, "error": await r.text(), "status": r.status}
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                error = obj["error"]
                continue
            for c in obj.get("choices", []):
                text.append(c.get("text", ""))
                finish = c.get("finish_reason") or finish
                if first_text is not None and c.get("text"):
                    first_text.set()
    return {"text": "".join(text), "finish_reason": finish, "error": error, "status": 200}


def request_bodies(num: int, max_tokens: tuple[int, int] = (32, 64), seed: int = 0) -> list[dict]:
    """Greedy and seeded requests, ignore_eos, of varying length."""
    rng = random.Random(seed)
    words = "the of and a to in is you that it he was for on are as with his they at".split()
    out = []
    for i in range(num):
        body = {"model": "tiny-moe", "prompt": " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))),
                "max_tokens": rng.randint(*max_tokens), "ignore_eos": True}
        if i % 2:
            body.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        else:
            body.update(temperature=0.0)
        out.append(body)
    return out


# -- the benchmark ---------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run_bench(args) -> int:
    root = Path(tempfile.mkdtemp(prefix="pl-bench-fault-"))
    cluster = Cluster(root, num_engines=args.engines)
    rows: dict[str, list[float]] = {"reaped": [], "notice": [], "replay": [], "token": [], "serving": []}
    mismatches = 0
    try:
        t0 = time.monotonic()
        cluster.start()
        print(f"stack up in {time.monotonic() - t0:.1f} s (frontend + {args.engines} engines)", file=sys.stderr)
        bodies = request_bodies(args.streams, (args.max_tokens, args.max_tokens), seed=1)

        async def reference() -> list[dict]:
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*[stream_completion(s, cluster.base, b) for b in bodies])
        expected = [r["text"] for r in asyncio.run(reference())]

        for trial in range(args.trials):
            cluster.wait_ready()
            index = trial % args.engines
            before = cluster.metrics()
            replays_before = before.get("planaria_request_replays_total", 0.0)

            async def one_trial():
                async with aiohttp.ClientSession() as s:
                    started = [asyncio.Event() for _ in bodies]
                    tasks = [asyncio.create_task(stream_completion(s, cluster.base, b, e))
                             for b, e in zip(bodies, started)]
                    await asyncio.gather(*[e.wait() for e in started])  # every stream is producing
                    killed_at = cluster.fault(index, "kill")
                    return killed_at, await asyncio.gather(*tasks)
            killed_at, results = asyncio.run(one_trial())
            label = f'{{engine="{index}"}}'
            deadline = time.monotonic() + 60
            while True:  # the frontend saw the death and the new incarnation's READY
                m = cluster.metrics()
                if m[f"planaria_engine_last_ready_timestamp_seconds{label}"] > killed_at \
                        and m[f"planaria_engine_last_death_timestamp_seconds{label}"] > killed_at:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine {index} not back within 60 s\n{cluster.logs()}")
                time.sleep(0.05)
            notice = m[f"planaria_engine_last_death_timestamp_seconds{label}"] - killed_at
            serving = m[f"planaria_engine_last_ready_timestamp_seconds{label}"] - killed_at
            replayed = m.get("planaria_request_replays_total", 0.0) - replays_before
            reaped = [t for i, t, _ in cluster.exits if i == index and t >= killed_at][0] - killed_at
            rows["reaped"].append(reaped)
            rows["notice"].append(notice)
            rows["serving"].append(serving)
            if replayed:
                rows["replay"].append(m["planaria_replay_last_start_timestamp_seconds"] - killed_at)
                rows["token"].append(m["planaria_replay_last_first_token_timestamp_seconds"] - killed_at)
            bad = sum(r["text"] != e or r["error"] is not None for r, e in zip(results, expected))
            mismatches += bad
            print(f"trial {trial:2d}: engine {index} reaped {reaped * 1e3:6.1f} ms  notice {notice * 1e3:6.1f} ms  replays {int(replayed):2d}  "
                  f"serving again {serving:5.2f} s  mismatches {bad}", file=sys.stderr)
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)

    print(f"\nfault recovery, {args.trials} SIGKILLs, {args.engines} engines, {args.streams} streams of "
          f"{args.max_tokens} tokens (tiny-moe, CPU, {os.cpu_count()} cores)")
    print(f"{'from SIGKILL to':<44}{'n':>4}{'p50':>11}{'p99':>11}{'max':>11}")
    names = {"reaped": "the engine reaped (supervisor's waitpid)",
             "notice": "ENGINE_CORE_DEAD processed by the frontend",
             "replay": "every lost request resubmitted",
             "token": "every replay's first token at the frontend",
             "serving": "the restarted engine READY"}
    for key, label in names.items():
        v = rows[key]
        if not v:
            print(f"{label:<44}{0:>4}{'-':>11}{'-':>11}{'-':>11}")
            continue
        print(f"{label:<44}{len(v):>4}" + "".join(f"{x * 1e3:>9.1f}ms" for x in
                                                  (_pct(v, 0.5), _pct(v, 0.99), max(v))))
    print(f"streams whose text differed from the fault-free run, or failed: {mismatches}")
    return 1 if mismatches else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fault_recovery", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    return run_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
