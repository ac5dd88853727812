"""Weight versions end to end, for real: `planaria serve` (supervisor, frontend, 2 engine
processes) on a tiny-moe checkpoint; responses and /v1/models carry weight_version, and
`planaria load-weights` swaps a second checkpoint of the same preset (another seed) in
through the supervisor -> frontend admin socket -> engines, changing version and text.

The tests run in order against one daemon (module fixture); every process is stopped by
pid at the end.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
PLANARIA = [sys.executable, "-m", "planaria.daemon.cli"]
ENGINE_CONFIG = {"kv_cache_bytes": 16 * 2**20, "max_model_len": 256, "max_num_seqs": 16,
                 "max_num_batched_tokens": 512, "num_threads": 1}
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # token ids: the same prompt for HTTP and the offline reference
MAX_TOKENS = 8

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, model: str, root: Path) -> None:
        self.root = root
        self.state = root / "state"
        self.runtime = Path(tempfile.mkdtemp(prefix="pl-lw-"))  # short: ipc paths (sun_path)
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        self.log_path = root / "serve.log"
        cmd = [*PLANARIA, "serve", "--model", model, "--engines", "2", "--http", f"127.0.0.1:{self.port}",
               "--state-dir", str(self.state), "--runtime-dir", str(self.runtime),
               "--engine-config-json", json.dumps(ENGINE_CONFIG), "--stop-timeout-s", "10"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=open(self.log_path, "wb"),
                                     stderr=subprocess.STDOUT)

    def cli(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run([*PLANARIA, *args, "--runtime-dir", str(self.runtime)], cwd=REPO,
                              env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def logs(self) -> str:
        parts = [f"--- serve\n{self.log_path.read_text(errors='replace')[-3000:]}"]
        for p in sorted((self.state / "logs").glob("*.log")):
            parts.append(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}")
        return "\n".join(parts)

    def http(self, path: str, body: dict | None = None, timeout_s: float = 60.0) -> tuple[int, str]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError as exc:
            return 0, str(exc)

    def wait_ready(self, timeout_s: float = 150.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve exited {self.proc.returncode}\n{self.logs()}"
            status, text = self.http("/ready", timeout_s=2)
            if status == 200 and json.loads(text)["num_healthy_engines"] == 2:
                return
            time.sleep(0.3)
        raise AssertionError(f"not ready within {timeout_s}s\n{self.logs()}")

    def complete(self, **kw) -> dict:
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}
        status, text = self.http("/v1/completions", body)
        assert status == 200, text
        return json.loads(text)

    def stream(self, path: str, body: dict, chunks: list | None = None) -> list[dict]:
        """The SSE chunks, appended to ``chunks`` as they arrive."""
        req = urllib.request.Request(self.base + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"content-type": "application/json"})
        chunks = [] if chunks is None else chunks
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        return chunks

    def models(self) -> dict:
        status, text = self.http("/v1/models")
        assert status == 200, text
        return json.loads(text)["data"][0]


def _stop_tree(proc: subprocess.Popen, timeout_s: float = 20.0) -> int | None:
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    return proc.returncode


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from planaria.engine.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("lw-models")
    out = {name: str(build_demo_model(root / name, preset, seed=seed, progress=lambda _: None))
           for name, preset, seed in (("a", "tiny-moe", 0), ("b", "tiny-moe", 1), ("dense", "tiny-dense", 0))}
    # same config as "b", one tensor of the wrong shape: passes the quick check, fails the read
    from safetensors.torch import load_file, save_file

    bad = root / "bad-shapes"
    shutil.copytree(out["b"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("o_proj.weight"))
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    out["bad"] = str(bad)
    return out


@pytest.fixture(scope="module")
def daemon(ckpts, tmp_path_factory):
    d = Daemon(ckpts["a"], tmp_path_factory.mktemp("load-weights"))
    try:
        d.wait_ready()
        yield d
    finally:
        code = _stop_tree(d.proc)
        shutil.rmtree(d.runtime, ignore_errors=True)
        assert code == 0, f"serve exited {code}\n{d.logs()}"


@functools.lru_cache(maxsize=None)
def _reference_text(model: str) -> str:
    from planaria.engine.llm import LLM
    from planaria.engine.sampling_params import SamplingParams

    llm = LLM(model, num_kv_blocks=32, max_model_len=64)
    return llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0].text


def test_responses_and_models_carry_the_weight_version(daemon, ckpts):
    from planaria.engine.models.loader import model_fingerprint

    v_a = model_fingerprint(ckpts["a"])
    m = daemon.models()
    assert m["weight_version"] == v_a and m["weight_versions"] == {"0": v_a, "1": v_a}
    r = daemon.complete()
    assert r["weight_version"] == v_a and r["choices"][0]["text"] == _reference_text(ckpts["a"])
    chunks = daemon.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                               "ignore_eos": True, "stream_options": {"include_usage": True}})
    # outputs may be coalesced into fewer chunks when the client reads behind; every chunk carries the version
    assert len(chunks) >= 2 and {c["weight_version"] for c in chunks} == {v_a}
    chat = daemon.stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 4, "ignore_eos": True})
    assert chat[0]["choices"][0]["delta"].get("role") == "assistant"  # the role chunk carries it too
    assert len(chat) >= 2 and {c["weight_version"] for c in chat} == {v_a}
    status, text = daemon.http("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 3})
    assert status == 200 and json.loads(text)["weight_version"] == v_a


def test_bad_directory_and_incompatible_checkpoints_change_nothing(daemon, ckpts, tmp_path):
    before = daemon.models()["weight_versions"]
    r = daemon.cli("load-weights", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "not a directory" in r.stderr, r.stderr
    r = daemon.cli("load-weights", ckpts["dense"])
    assert r.returncode == 2 and "architecture" in r.stderr, r.stderr
    r = daemon.cli("load-weights", str(tmp_path))  # a directory, but no checkpoint in it
    assert r.returncode == 2 and "config.json" in r.stderr, r.stderr
    r = daemon.cli("load-weights", ckpts["b"], "--engine", "7")
    assert r.returncode == 4 and "no engine 7" in r.stderr, r.stderr
    # right config, wrong tensor shape: accepted, then refused by each engine's read
    r = daemon.cli("load-weights", ckpts["bad"], "--policy", "continue_new")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("failed, old weights kept") == 2 and "o_proj" in r.stderr, r.stderr
    assert daemon.models()["weight_versions"] == before
    assert daemon.complete()["choices"][0]["text"] == _reference_text(ckpts["a"])
    status = daemon.cli("load-weights", "--status")
    assert status.returncode == 0 and status.stdout.count("failed") == 2, status.stdout


def _load_while_two_streams_run(daemon, *cli_args: str):
    """Two streams (least-loaded routing: one per engine), then `planaria load-weights
    ARGS` once both have chunks. Returns (the CLI's result, each stream's chunks); the load
    overlapped both streams."""
    streams: list[list[dict]] = [[], []]
    ended_at: list[float] = []
    body = {"prompt": PROMPT, "max_tokens": 150, "ignore_eos": True}

    def stream(i: int) -> None:
        daemon.stream("/v1/completions", body, streams[i])
        ended_at.append(time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not all(streams) and time.monotonic() < deadline:
        time.sleep(0.02)
    load_at = time.monotonic()
    r = daemon.cli("load-weights", *cli_args)
    for t in threads:
        t.join(60)
    assert min(ended_at) > load_at  # the load overlapped both streams
    return r, streams


def test_finish_old_on_one_engine_while_streams_run(daemon, ckpts):
    """Engine 0 only, finish_old, while a stream runs on each engine: both end on the old
    weights; then engine 0 serves the new version while engine 1 keeps the old one."""
    from planaria.engine.weight_update import content_version

    v_a, v_b = daemon.models()["weight_version"], content_version(ckpts["b"])
    r, streams = _load_while_two_streams_run(daemon, ckpts["b"], "--engine", "0", "--policy", "finish_old")
    assert r.returncode == 0 and f"engine 0: applied, weight version {v_b}" in r.stdout, (r.stdout, r.stderr)
    for chunks in streams:
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks if c["choices"]) > 0
        assert {c["weight_version"] for c in chunks} == {v_a}  # all of it on the old weights
    m = daemon.models()
    assert m["weight_versions"] == {"0": v_b, "1": v_a} and m["weight_version"] is None
    seen = {daemon.complete()["weight_version"] for _ in range(6)}  # both engines take requests
    assert seen == {v_a, v_b}


def test_the_default_policy_on_every_engine_finishes_streams_on_their_old_weights(daemon, ckpts):
    """No --policy (hand_over) on every engine at once, while a stream runs on each: no
    engine is left on its old weights with no load of its own to take them, so each stream
    finishes where it runs, on its engine's old version, as with finish_old; then every
    engine serves the new one. (The version name is new, so an engine that swapped first
    is not on the other's old version.)"""
    before = set(daemon.models()["weight_versions"].values())
    r, streams = _load_while_two_streams_run(daemon, ckpts["a"], "--version", "a-2")
    assert r.returncode == 0 and r.stdout.count("applied, weight version a-2") == 2, (r.stdout, r.stderr)
    for chunks in streams:
        versions = {c["weight_version"] for c in chunks}
        assert len(versions) == 1 and versions <= before, (versions, before)  # not moved, old weights
    assert daemon.models()["weight_versions"] == {"0": "a-2", "1": "a-2"}


def test_continue_new_on_every_engine_changes_version_and_text(daemon, ckpts):
    from planaria.engine.weight_update import content_version

    v_b = content_version(ckpts["b"])
    r = daemon.cli("load-weights", ckpts["b"], "--policy", "continue_new", "--version", "b-1")
    assert r.returncode == 0 and r.stdout.count("applied, weight version b-1") == 2, (r.stdout, r.stderr)
    m = daemon.models()
    assert m["weight_version"] == "b-1" and m["weight_versions"] == {"0": "b-1", "1": "b-1"}
    want = _reference_text(ckpts["b"])
    assert want != _reference_text(ckpts["a"])
    for _ in range(4):  # both engines: the new weights' text, the new version
        r = daemon.complete()
        assert r["weight_version"] == "b-1" and r["choices"][0]["text"] == want
    assert v_b != "b-1"
