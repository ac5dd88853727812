"""`planaria serve` under a real systemd (systemd-nspawn), from a test copy of the shipped
unit: READY, reload, restart after the main process is killed, the watchdog, a clean stop.

The container sees the repository, the venv and the Python installation the venv points
at, and the demo model, all bound read-only; the unit's state and runtime dirs are the
container's own (/var/lib/planaria, /run/planaria).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.daemon.nspawn import NspawnSystem, unavailable_reason

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "planaria.service"
VENV = REPO / ".venv"
ENGINE_CONFIG = {"kv_cache_bytes": 16 * 2**20, "max_model_len": 1024, "num_threads": 1}
DRAIN_MAX_TOKENS = 900  # long enough to be in flight when `systemctl stop` begins
MODEL_INSIDE = Path("/srv/planaria-test-model")  # PrivateTmp= hides the host's /tmp

pytestmark = [pytest.mark.systemd, pytest.mark.timeout(420)]


def _python_home() -> Path:
    """The installation the venv's python links to (e.g. /root/.pyenv/versions/3.11.7)."""
    real = (VENV / "bin" / "python").resolve()
    return real.parents[1]


class _Stream(threading.Thread):
    """One streaming completion over plain HTTP; keeps each chunk's arrival time."""

    def __init__(self, port: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.port, self.max_tokens = port, max_tokens
        self.chunk_times: list[float] = []
        self.finish_reason = None
        self.usage = None
        self.done = False
        self.error: BaseException | None = None
        self.first_chunk = threading.Event()

    def run(self) -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            body = {"model": MODEL_INSIDE.name, "prompt": "the system is stopping", "max_tokens": self.max_tokens,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done = True
                    break
                obj = json.loads(line[len("data: "):])
                self.usage = obj.get("usage") or self.usage
                for c in obj.get("choices", []):
                    self.finish_reason = c.get("finish_reason") or self.finish_reason
                    if c.get("text"):
                        self.chunk_times.append(time.monotonic())
                        self.first_chunk.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.first_chunk.set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _install_unit(unit_dir: Path, args: str) -> None:
    """A test copy of the shipped unit in ``unit_dir``: this venv's planaria, an env file
    there with ``args``, short watchdog and restart delays; every hardening setting kept."""
    (unit_dir / "engine.json").write_text(json.dumps(ENGINE_CONFIG))
    (unit_dir / "planaria.env").write_text(f"PLANARIA_ARGS='{args}'\nPLANARIA_LOG_LEVEL=INFO\n")
    text = UNIT.read_text()
    text = text.replace(
        "ExecStart=/opt/planaria/.venv/bin/planaria serve --env-file /etc/planaria/planaria.env",
        f"ExecStart={VENV}/bin/planaria serve --env-file /etc/systemd/system/planaria.env")
    text = text.replace("EnvironmentFile=-/etc/planaria/planaria.env",
                        "EnvironmentFile=/etc/systemd/system/planaria.env")
    text = text.replace("WatchdogSec=30", "WatchdogSec=4").replace("RestartSec=2", "RestartSec=1")
    text = text.replace("TimeoutStopSec=60", "TimeoutStopSec=40\nTimeoutAbortSec=3")
    text = text.replace("\n[Service]\n", "\n[Service]\nEnvironment=OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1\n")
    # A checkout (or Python) under /tmp: the service's private /tmp would hide its venv, and
    # DynamicUser= implies PrivateTmp=, so the paths are bound into the service's namespace.
    under_tmp = [p for p in (REPO, _python_home()) if p.is_relative_to("/tmp")]
    if under_tmp:
        text = text.replace("\n[Service]\n", "\n[Service]\nBindReadOnlyPaths="
                            + " ".join(str(p) for p in under_tmp) + "\n")
    assert f"ExecStart={VENV}/bin/planaria serve" in text
    (unit_dir / "planaria.service").write_text(text)


@contextlib.contextmanager
def _container(tiny_moe: str, tmp_path: Path, args: str):
    """Boot a container with the test unit installed (not started yet)."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    if not (VENV / "bin" / "planaria").exists():
        pytest.skip("no .venv/bin/planaria (pip install -e . first)")
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    _install_unit(unit_dir, args)
    # The unit's dynamic user reads the model: a world-readable copy (the weights file is
    # written 0600; under /var/lib/planaria systemd would chown it to the user instead).
    model = tmp_path / "model"
    shutil.copytree(tiny_moe, model)
    for path in model.iterdir():
        path.chmod(0o644)
    binds = [(REPO, REPO), (_python_home(), _python_home()), (model, MODEL_INSIDE)]
    with NspawnSystem(unit_dir, binds_ro=binds) as system:
        print(f"container booted in {system.boot_s:.1f}s")
        # The unit runs as a dynamic user: it must be able to walk to what is bound in.
        # Their parents are the container's own (tmpfs) directories, /root among them at
        # 0700 when the Python installation is a pyenv one there; a bind is read-only, so
        # this changes nothing of the host.
        system.open_paths([REPO, _python_home(), MODEL_INSIDE])
        yield system


def _wait_active(system: NspawnSystem, num_engines: int, timeout_s: float = 120.0,
                 restarts: int | None = None) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        p = system.show("planaria.service", "ActiveState", "SubState", "NRestarts", "StatusText",
                        "MainPID")
        if p["ActiveState"] == "active" and p["SubState"] == "running" and \
                (restarts is None or p["NRestarts"] == str(restarts)) and \
                f"{num_engines}/{num_engines} engines up" in p["StatusText"]:
            return p
        time.sleep(0.5)
    raise AssertionError(f"not active: {p}\n{system.journal('planaria.service', 80)}")


def test_unit_under_real_systemd(tiny_moe, tmp_path):
    port = _free_port()
    args = (f"--model {MODEL_INSIDE} --engines 1 --http 127.0.0.1:{port} "
            "--engine-config-json @/etc/systemd/system/engine.json "
            f"--stop-timeout-s 20")
    unit_dir = tmp_path / "units"
    with _container(tiny_moe, tmp_path, args) as system:
        def show(*props):
            return system.show("planaria.service", *props)

        def cli(*argv, timeout_s=30.0):
            return system.run([f"{VENV}/bin/planaria", *argv], timeout_s=timeout_s)

        def wait_active(timeout_s=120.0, restarts=None):
            return _wait_active(system, 1, timeout_s, restarts)

        started = time.monotonic()
        result = system.systemctl("start", "planaria.service", timeout_s=150)
        assert result.returncode == 0, system.journal("planaria.service", 80)
        props = wait_active()
        print(f"active (READY=1) {time.monotonic() - started:.1f}s after start: {props['StatusText']}")
        assert show("WatchdogUSec")["WatchdogUSec"] == "4s"
        status = json.loads(cli("status", "--json").stdout)  # finds /run/planaria itself
        assert status["num_up"] == 1 and status["state_dir"] == "/var/lib/planaria"
        first_pid = props["MainPID"]

        # reload: RELOADING=1, re-read the env file, READY=1; the same process serves on
        (unit_dir / "planaria.env").write_text(
            f"PLANARIA_ARGS='{args} --hang-timeout-s 45'\nPLANARIA_LOG_LEVEL=DEBUG\n")
        result = system.systemctl("reload", "planaria.service", timeout_s=30)
        assert result.returncode == 0, system.journal("planaria.service", 40)
        time.sleep(0.5)
        props = wait_active(restarts=0)
        assert props["MainPID"] == first_pid
        journal = system.journal("planaria.service", 200)
        assert '"event": "reloaded"' in journal and "hang_timeout_s" in journal

        # the main process killed outright: children die with it, systemd restarts it
        system.run(["kill", "-KILL", first_pid], check=True)
        props = wait_active(restarts=1)
        assert props["MainPID"] != first_pid
        print("restarted after SIGKILL of the main process")

        # a stopped supervisor stops its WATCHDOG=1 pings: systemd aborts and restarts it
        stopped_pid = props["MainPID"]
        system.run(["kill", "-STOP", stopped_pid], check=True)
        t0 = time.monotonic()
        props = wait_active(restarts=2, timeout_s=150)
        print(f"watchdog restart {time.monotonic() - t0:.1f}s after SIGSTOP")
        assert props["MainPID"] != stopped_pid
        assert "watchdog" in system.journal("planaria.service", 400).lower()

        # stop: STOPPING=1, children drained (a stream in flight runs to its end), exit 0
        stream = _Stream(port, DRAIN_MAX_TOKENS)
        stream.start()
        assert stream.first_chunk.wait(60) and stream.error is None, stream.error
        t0 = time.monotonic()
        result = system.systemctl("stop", "planaria.service", timeout_s=60)
        assert result.returncode == 0
        stopped_s = time.monotonic() - t0
        stream.join(30)
        props = show("ActiveState", "Result", "ExecMainStatus", "ExecMainCode")
        print(f"stopped in {stopped_s:.1f}s: {props}; the stream in flight got "
              f"{len(stream.chunk_times)} chunks, {sum(t > t0 for t in stream.chunk_times)} "
              f"of them after the stop began")
        assert stream.error is None, stream.error
        assert stream.done and stream.finish_reason == "length", (stream.finish_reason, stream.done)
        assert stream.usage and stream.usage["completion_tokens"] == DRAIN_MAX_TOKENS, stream.usage
        assert stream.chunk_times[0] < t0 < stream.chunk_times[-1]  # in flight across the stop
        assert (props["ActiveState"], props["Result"], props["ExecMainStatus"]) == (
            "inactive", "success", "0"), system.journal("planaria.service", 80)
        journal = system.journal("planaria.service", 400)
        assert '"event": "stopped"' in journal and '"exit_code": 0' in journal


def test_ep_mode_under_the_hardened_unit(tiny_moe, tmp_path):
    """The shipped default: EP with the embedded etcd (Go), gloo between two ranks, as the
    unit's unprivileged dynamic user with no capabilities under its syscall filter."""
    port = _free_port()
    args = (f"--model {MODEL_INSIDE} --engines 2 --parallel ep --standby 0 "
            f"--http 127.0.0.1:{port} --engine-config-json @/etc/systemd/system/engine.json "
            "--stop-timeout-s 20")
    with _container(tiny_moe, tmp_path, args) as system:
        started = time.monotonic()
        result = system.systemctl("start", "planaria.service", timeout_s=150)
        assert result.returncode == 0, system.journal("planaria.service", 80)
        props = _wait_active(system, 2, timeout_s=180)
        print(f"EP active {time.monotonic() - started:.1f}s after start: {props['StatusText']}")
        proc_status = system.run(["cat", f"/proc/{props['MainPID']}/status"], check=True).stdout
        fields = dict(line.split(":", 1) for line in proc_status.splitlines() if ":" in line)
        uid = int(fields["Uid"].split()[0])
        assert uid != 0, fields["Uid"]
        assert int(fields["CapEff"], 16) == int(fields["CapBnd"], 16) == 0, proc_status
        assert fields["Seccomp"].strip() == "2" and fields["NoNewPrivs"].strip() == "1"
        status = json.loads(system.run([f"{VENV}/bin/planaria", "status", "--json"]).stdout)
        ep = status["ep"]
        assert ep["world_size"] == 2 and all(e["state"] == "serving" for e in ep["engines"].values()), ep
        etcd_dir = system.run(["stat", "-c", "%u %a", "/var/lib/planaria/etcd"], check=True).stdout.split()
        assert etcd_dir == [str(uid), "700"], etcd_dir

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"model": MODEL_INSIDE.name, "prompt": "def main(argv):", "max_tokens": 8,
                "temperature": 0.0, "ignore_eos": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        reply = resp.read()
        assert resp.status == 200, reply
        assert json.loads(reply)["usage"]["completion_tokens"] == 8

        result = system.systemctl("stop", "planaria.service", timeout_s=60)
        assert result.returncode == 0
        props = system.show("planaria.service", "ActiveState", "Result", "ExecMainStatus", "NRestarts")
        assert props == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0",
                         "NRestarts": "0"}, system.journal("planaria.service", 80)
