"""`planaria serve` for real with a frontend whose event loop freezes: the supervisor sees
its liveness beats stop, SIGKILLs it after --frontend-hang-timeout-s, restarts it (and its
engine), and the daemon serves again.

The freeze is the frontend's own fault injection (frontend/liveness.py: with
PLANARIA_FAULT_INJECTION=1, PLANARIA_FRONTEND_FREEZE_FILE=PATH blocks the loop in
time.sleep once PATH exists, removing it first, so the restarted frontend serves). Not
SIGSTOP: a stopped process is not a frozen loop in a running one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.test_supervisor import ENGINE_CONFIG, PLANARIA, REPO, _free_port, _stop_tree

FRONTEND_HANG_TIMEOUT_S = 2.0

pytestmark = pytest.mark.timeout(180)


def _get(url: str, timeout_s: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.status


def test_frozen_frontend_event_loop_is_killed_restarted_and_serves_again(tiny_moe, tmp_path):
    runtime = Path(tempfile.mkdtemp(prefix="pl-fh-"))  # ipc paths must stay short
    freeze = tmp_path / "freeze-now"
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PLANARIA_LOG_FORMAT="json", PLANARIA_FAULT_INJECTION="1",
               PLANARIA_FRONTEND_FREEZE_FILE=str(freeze))
    log_path = tmp_path / "serve.log"
    cmd = [*PLANARIA, "serve", "--model", tiny_moe, "--engines", "1", "--http", f"127.0.0.1:{port}",
           "--state-dir", str(tmp_path / "state"), "--runtime-dir", str(runtime),
           "--engine-config-json", json.dumps(ENGINE_CONFIG), "--heartbeat-interval-s", "0.25",
           "--frontend-hang-timeout-s", str(FRONTEND_HANG_TIMEOUT_S),
           "--restart-backoff-s", "0.2", "--stop-timeout-s", "5", "--stable-s", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)

    def logs() -> str:
        parts = [f"--- serve\n{log_path.read_text(errors='replace')[-4000:]}"]
        for p in sorted((tmp_path / "state" / "logs").glob("*.log")):
            parts.append(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}")
        return "\n".join(parts)

    def status() -> dict | None:
        result = subprocess.run([*PLANARIA, "status", "--json", "--runtime-dir", str(runtime)], cwd=REPO,
                                env=env, capture_output=True, text=True, timeout=60)
        if result.returncode == 3:  # the control socket is not bound yet
            return None
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def wait(predicate, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"serve exited {proc.returncode}\n{logs()}"
            last = status()
            if last is not None and predicate(last):
                return last
            time.sleep(0.1)
        raise AssertionError(f"no {what} within {timeout_s}s: {last}\n{logs()}")

    def serving(s: dict) -> bool:
        return s["num_up"] == 1 and s["frontend"]["state"] == "running" \
            and s["frontend"]["last_answer_age_s"] is not None

    try:
        before = wait(serving, 120, "daemon serving")
        fe = before["frontend"]
        assert fe["restarts"] == 0 and fe["hang_timeout_s"] == FRONTEND_HANG_TIMEOUT_S
        assert fe["last_answer_age_s"] < FRONTEND_HANG_TIMEOUT_S and fe["num_answers"] >= 1
        text = subprocess.run([*PLANARIA, "status", "--runtime-dir", str(runtime)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60).stdout
        assert "event loop answered" in text, text

        freeze.touch()
        frozen_at = time.monotonic()
        while freeze.exists():  # the frontend's loop removes it just before it freezes
            assert time.monotonic() - frozen_at < 10, logs()
            time.sleep(0.02)
        with pytest.raises((urllib.error.URLError, TimeoutError, OSError)):
            _get(base + "/health", timeout_s=0.5)  # frozen: not even /health answers

        after = wait(lambda s: s["frontend"]["pid"] not in (None, fe["pid"]), 30, "a new frontend")
        took_s = time.monotonic() - frozen_at
        print(f"frozen frontend loop -> killed and restarted in {took_s:.1f} s "
              f"(limit {FRONTEND_HANG_TIMEOUT_S} s)")
        assert took_s < FRONTEND_HANG_TIMEOUT_S + 6, logs()
        reason = after["frontend"]["reason"]
        assert reason.startswith("frontend hung: event loop did not answer for "), after
        assert after["frontend"]["restarts"] == 1
        kills = [json.loads(line) for line in log_path.read_text().splitlines()
                 if '"hung; SIGKILL"' in line and '"frontend"' in line]
        assert kills and kills[0]["pid"] == fe["pid"], logs()

        after = wait(serving, 90, "serving again")
        text = subprocess.run([*PLANARIA, "status", "--runtime-dir", str(runtime)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60).stdout
        assert "frontend last exit: frontend hung: event loop did not answer for" in text, text
        assert _get(base + "/health", timeout_s=10) == 200
        req = urllib.request.Request(base + "/v1/completions", headers={"content-type": "application/json"},
                                     data=json.dumps({"model": "tiny-moe", "prompt": "hello", "max_tokens": 4,
                                                      "ignore_eos": True}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            assert json.loads(r.read())["choices"][0]["finish_reason"] == "length"
    finally:
        _stop_tree(proc)
        shutil.rmtree(runtime, ignore_errors=True)
