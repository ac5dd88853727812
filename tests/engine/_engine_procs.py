"""Helpers for tests that run real engine-core processes on real sockets.

No fakes here: ``spawn_engine`` starts ``python -m planaria.engine.proc`` on the tiny-moe demo
model (the ``tiny_moe`` fixture of tests/conftest.py); ``RawFrontend`` is a bare ROUTER + PULL pair that speaks the wire protocol by hand;
``LoopThread`` runs an asyncio loop (and an EngineClient) for tests without pytest-asyncio.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import zmq

from planaria.engine.messages import EngineCoreRequest
from planaria.engine.sampling_params import SamplingParams
from planaria.engine.wire import (FRONTEND_INPUT_TYPES, HandshakeInit, MsgType, WireDecoder, WireEncoder,
                         engine_identity)

REPO = Path(__file__).resolve().parents[2]


def engine_config(model: Path, **kw) -> dict:
    cfg = dict(model=str(model), kv_cache_bytes=8 * 2**20, max_model_len=256, max_num_seqs=32,
               max_num_batched_tokens=512, num_threads=1)
    cfg.update(kw)
    return cfg


def spawn_engine(index: int, input_addr: str, log_dir: Path, config: dict | None = None,
                 settings: dict | None = None, fault_injection: bool = False,
                 env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "planaria.engine.proc", "--engine-index", str(index), "--input-addr", input_addr]
    if config is not None:
        cmd += ["--config-json", msgspec.json.encode(config).decode()]
    cmd += ["--settings-json", msgspec.json.encode({"handshake_timeout_s": 60.0, **(settings or {})}).decode()]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(env or {}))
    if fault_injection:
        env["PLANARIA_FAULT_INJECTION"] = "1"
    log = open(log_dir / f"engine{index}-{time.monotonic_ns()}.log", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log.name
    log.close()
    return proc


def stop_engine(proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """Stop by pid: SIGTERM, then SIGKILL. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
    return proc.returncode


def engine_log(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text(errors="replace")[-4000:]


def request(rid: str, max_tokens: int = 8, prompt: list[int] | None = None, **sp) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt or [11, 12, 13, 14, 15],
                             sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                            ignore_eos=True, **sp))


class RawFrontend:
    """A frontend written against the wire protocol directly (sync zmq)."""

    def __init__(self, tmp: Path, name: str = "raw") -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.input_addr = f"ipc://{tmp / (name + '-in')}"
        self.router.bind(self.input_addr)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.output_addr = f"ipc://{tmp / (name + '-out')}"
        self.pull.bind(self.output_addr)
        self.enc = WireEncoder(reuse_buffer=False)
        self.dec = WireDecoder(FRONTEND_INPUT_TYPES)
        self.outputs: dict[str, list] = {}
        self.statuses: list = []  # every EngineStatus seen, in order
        self.iterations: list = []  # (message timestamp, IterationDetails) when the engine sends them

    def recv_router(self, timeout_s: float = 60.0):
        if not self.router.poll(int(timeout_s * 1000)):
            raise TimeoutError("nothing on the ROUTER")
        identity, *frames = self.router.recv_multipart()
        return identity, *self.dec.decode(frames)

    def recv_pull(self, timeout_s: float = 30.0):
        """Next message on the PULL socket; outputs and statuses are also kept."""
        if not self.pull.poll(int(timeout_s * 1000)):
            raise TimeoutError("nothing on the PULL socket")
        t, msg = self.dec.decode(self.pull.recv_multipart())
        if t == MsgType.OUTPUTS:
            for out in msg.outputs:
                self.outputs.setdefault(out.request_id, []).append(out)
            self.iterations.extend((msg.timestamp, d) for d in msg.iteration_details or ())
        elif t == MsgType.STATUS:
            self.statuses.append(msg)
        return t, msg

    def send(self, index: int, msg_type: bytes, msg) -> None:
        self.router.send_multipart([engine_identity(index), *self.enc.encode(msg_type, msg)])

    def send_raw(self, index: int, frames: list[bytes]) -> None:
        self.router.send_multipart([engine_identity(index), *frames])

    def handshake(self, index: int = 0, settings: dict | None = None, protocol_version: int | None = None,
                  timeout_s: float = 60.0):
        """HELLO -> HANDSHAKE_INIT -> READY. Returns (hello, ready)."""
        identity, t, hello = self.recv_router(timeout_s)
        assert t == MsgType.HELLO and identity == engine_identity(index)
        init = HandshakeInit(addresses={"output": self.output_addr}, settings=settings or {})
        if protocol_version is not None:
            init.protocol_version = protocol_version
        self.send(index, MsgType.HANDSHAKE_INIT, init)
        if protocol_version is not None:
            return hello, None
        while True:
            _, t, ready = self.recv_router(timeout_s)
            if t == MsgType.READY:
                return hello, ready

    def collect(self, request_ids: set[str], timeout_s: float = 60.0) -> dict[str, list]:
        """All outputs (also those seen earlier) of these requests, once every one finished."""
        deadline = time.monotonic() + timeout_s

        def done(rid):
            outs = self.outputs.get(rid)
            return bool(outs) and outs[-1].finished

        while not all(done(rid) for rid in request_ids):
            self.recv_pull(max(0.1, deadline - time.monotonic()))
        return {rid: self.outputs[rid] for rid in request_ids}

    def close(self) -> None:
        self.router.close(0)
        self.pull.close(0)
        self.ctx.term()


class LoopThread:
    """An asyncio loop on a thread, so one EngineClient can outlive a single test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
