"""systemd: the shipped unit verifies, and sd_notify works against a real systemd."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemon.nspawn import NspawnSystem, unavailable_reason

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "planaria.service"
INSTALLED_BIN = "/opt/planaria/.venv/bin/planaria"

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze is not installed")


def verify(unit_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", str(unit_path)],
                          capture_output=True, text=True, timeout=60)


@needs_analyze
def test_unit_verifies(tmp_path):
    # verify also checks that ExecStart's program exists; where planaria is not installed
    # at the unit's fixed path, check a copy that points at an executable that exists.
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED_BIN} serve" in text
    if not Path(INSTALLED_BIN).exists():
        local_bin = Path(sys.executable).with_name("planaria")
        program = local_bin if local_bin.exists() else Path(sys.executable)
        text = text.replace(f"ExecStart={INSTALLED_BIN}", f"ExecStart={program}")
    unit = tmp_path / "planaria.service"
    unit.write_text(text)
    result = verify(unit)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.strip() == "", result.stderr


@needs_analyze
def test_verify_catches_a_broken_unit(tmp_path):
    unit = tmp_path / "planaria.service"
    unit.write_text(UNIT.read_text().replace("Type=notify", "Type=notfiy"))
    result = verify(unit)
    assert "notfiy" in result.stdout + result.stderr


def _unit_settings() -> dict[str, list[str]]:
    """The unit's KEY=value lines, every value of a repeated key in order."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";")):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def test_unit_settings():
    settings = {key: values[0] for key, values in _unit_settings().items()}
    expected = {
        "Type": "notify", "NotifyAccess": "main", "WatchdogSec": "30",
        "Restart": "on-failure", "RestartSec": "2", "KillMode": "mixed",
        "TimeoutStopSec": "60", "ExecReload": "/bin/kill -HUP $MAINPID",
        "RuntimeDirectory": "planaria", "RuntimeDirectoryMode": "0700",
        "StateDirectory": "planaria", "NoNewPrivileges": "yes", "ProtectSystem": "strict",
        "ReadWritePaths": "/var/lib/planaria", "ProtectHome": "read-only", "PrivateTmp": "yes",
        "EnvironmentFile": "-/etc/planaria/planaria.env",
    }
    assert {k: settings.get(k) for k in expected} == expected


def test_unit_hardening():
    """Its own user, no capabilities, the kernel's knobs out of reach, the GPUs allowed."""
    settings = _unit_settings()
    single = {key: values[-1] for key, values in settings.items()}
    expected = {
        "DynamicUser": "yes", "CapabilityBoundingSet": "", "AmbientCapabilities": "",
        "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes",
        "ProtectControlGroups": "yes", "ProtectClock": "yes", "ProtectHostname": "yes",
        "RestrictNamespaces": "yes", "RestrictSUIDSGID": "yes", "LockPersonality": "yes",
        "SystemCallArchitectures": "native", "UMask": "0077", "DevicePolicy": "closed",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    }
    assert {k: single.get(k) for k in expected} == expected
    assert settings["SystemCallFilter"][0] == "@system-service"
    # oneDNN and Triton write machine code at run time; PrivateDevices= hides the GPUs
    assert "MemoryDenyWriteExecute" not in settings and "PrivateDevices" not in settings
    allowed = {value.split()[0] for value in settings["DeviceAllow"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "char-nvidia-frontend", "char-drm"} <= allowed
    assert all(value.split()[1] == "rw" for value in settings["DeviceAllow"])


def test_exec_start_is_a_serve_the_daemon_accepts():
    """ExecStart= runs `planaria serve` with flags the real command line parses (the
    example env file's PLANARIA_ARGS in place of $PLANARIA_ARGS, as systemd splits it), and
    the daemon then uses what the unit sets up: the env file systemd reads is the one it
    re-reads on reload, the directories are the unit's (from $STATE_DIRECTORY and
    $RUNTIME_DIRECTORY, as systemd passes them), and the exit code the unit does not
    restart is the daemon's configuration error."""
    from planaria.daemon.cli import build_parser
    from planaria.daemon.config import build, given_flags, parse_env_file
    from planaria.daemon.supervisor import EXIT_CONFIG

    settings = _unit_settings()
    (exec_start,) = settings["ExecStart"]
    program, *words = exec_start.split()
    assert program.startswith("/") and Path(program).name == "planaria"
    assert words[0] == "serve"
    example = parse_env_file((REPO / "systemd" / "planaria.env.example").read_text())
    argv = [arg for word in words
            for arg in (shlex.split(example["PLANARIA_ARGS"]) if word == "$PLANARIA_ARGS" else [word])]
    args = build_parser().parse_args(argv)
    assert args.command == "serve"
    flags = given_flags(args)
    assert "-" + flags["env_file"] in settings["EnvironmentFile"]
    state_dir = "/var/lib/" + settings["StateDirectory"][0]
    runtime_dir = "/run/" + settings["RuntimeDirectory"][0]
    config = build(flags, {"STATE_DIRECTORY": state_dir, "RUNTIME_DIRECTORY": runtime_dir})
    assert (config.state_dir, config.runtime_dir) == (state_dir, runtime_dir)
    assert config.state_dir in settings["ReadWritePaths"][0].split()  # writable under ProtectSystem=strict
    assert settings["RestartPreventExitStatus"] == [str(EXIT_CONFIG)]


def exposure(unit_path: Path) -> tuple[float, str]:
    """``systemd-analyze security --offline=yes``'s overall exposure (0 best, 10 worst)
    and its line."""
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                             str(unit_path)], capture_output=True, text=True, timeout=60)
    line = next((x for x in result.stdout.splitlines() if "Overall exposure level" in x), None)
    assert line is not None, result.stdout + result.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", line)
    assert match, line
    return float(match.group(1)), line.strip()


@needs_analyze
def test_exposure_is_at_most_2_5(tmp_path):
    figure, line = exposure(UNIT)
    print(line)
    assert figure <= 2.5, line


@needs_analyze
def test_exposure_check_sees_a_weakened_unit(tmp_path):
    # the check measures the file: the unit without its hardening lines scores far worse
    kept = [line for line in UNIT.read_text().splitlines()
            if not line.startswith(("DynamicUser", "CapabilityBoundingSet", "SystemCallFilter",
                                    "ProtectKernel", "RestrictAddressFamilies", "DevicePolicy"))]
    weak = tmp_path / "planaria.service"
    weak.write_text("\n".join(kept) + "\n")
    assert exposure(weak)[0] > exposure(UNIT)[0] + 2.0


PROBE = """\
import sys
import time

sys.path.insert(0, {repo!r})
from planaria.daemon.sd_notify import Notifier, watchdog_interval_s

notifier = Notifier.from_environ(unset_environment=True)
interval_s = watchdog_interval_s() or 1.0
notifier.status("warming up")
time.sleep(0.2)
notifier.ready(status="probe serving")
while True:
    if sys.argv[1:] != ["--no-watchdog"]:
        notifier.watchdog()
    time.sleep(interval_s)
"""

PROBE_UNIT = """\
[Unit]
Description=sd_notify probe

[Service]
Type=notify
NotifyAccess=main
ExecStart={python} /etc/systemd/system/notify_probe.py {args}
WatchdogSec=2
Restart=no
TimeoutStartSec=20
"""


@pytest.mark.systemd
@pytest.mark.timeout(120)
def test_notify_unit_under_real_systemd(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    python = "/usr/bin/python3"  # /usr is the one host tree visible in a volatile container
    if not Path(python).exists():
        pytest.skip(f"{python} is missing")
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    (unit_dir / "notify_probe.py").write_text(PROBE.format(repo=str(REPO)))
    (unit_dir / "notify-probe.service").write_text(PROBE_UNIT.format(python=python, args=""))
    # The same probe without pings, to show that the watchdog is really enforced.
    (unit_dir / "silent-probe.service").write_text(
        PROBE_UNIT.format(python=python, args="--no-watchdog"))

    with NspawnSystem(unit_dir, binds_ro=[(REPO / "planaria", REPO / "planaria")]) as system:
        print(f"container booted in {system.boot_s:.2f}s")
        started = time.monotonic()
        result = system.systemctl("start", "notify-probe.service", "silent-probe.service",
                                  timeout_s=30)
        assert result.returncode == 0, system.journal("notify-probe.service")
        print(f"Type=notify unit active in {time.monotonic() - started:.2f}s")
        assert system.systemctl("is-active", "notify-probe.service").stdout.strip() == "active"
        props = system.show("notify-probe.service", "StatusText", "WatchdogUSec", "SubState")
        assert props == {"StatusText": "probe serving", "WatchdogUSec": "2s",
                         "SubState": "running"}
        # Outlive two watchdog periods: only the probe's WATCHDOG=1 pings keep it alive.
        first = system.show("notify-probe.service", "WatchdogTimestampMonotonic")
        time.sleep(4.5)
        later = system.show("notify-probe.service", "ActiveState", "NRestarts", "Result",
                            "WatchdogTimestampMonotonic")
        assert (later["ActiveState"], later["NRestarts"], later["Result"]) == (
            "active", "0", "success"), system.journal("notify-probe.service")
        assert int(later["WatchdogTimestampMonotonic"]) > int(
            first["WatchdogTimestampMonotonic"]) > 0
        silent = system.show("silent-probe.service", "ActiveState", "Result")
        assert silent == {"ActiveState": "failed", "Result": "watchdog"}
