"""Shared pieces of the admin commands' CLI halves: finding the daemon, exit codes.

Exit codes of every admin command (also listed in `planaria --help` epilogs):
0 done; 1 internal error; 2 bad argument; 3 daemon not running; 4 unknown engine;
5 conflict (another operation in progress, or the state forbids it); 6 unavailable
(e.g. shutting down); 7 unknown command (the daemon is older than this CLI).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from daemon.envelope import ErrorCode
from daemon.errors import AdminError, ControlProtocolError, DaemonNotRunningError

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_ARGUMENT, EXIT_NOT_RUNNING = 0, 1, 2, 3
EXIT_BY_CODE = {ErrorCode.INTERNAL: 1, ErrorCode.BAD_ARGUMENT: 2, ErrorCode.UNKNOWN_ENGINE: 4,
                ErrorCode.CONFLICT: 5, ErrorCode.UNAVAILABLE: 6, ErrorCode.UNKNOWN_COMMAND: 7}
EXIT_CODES_HELP = ("exit codes: 0 done, 1 internal error, 2 bad argument, 3 daemon not "
                   "running, 4 unknown engine, 5 conflict, 6 unavailable")
SYSTEM_RUNTIME_DIR = "/run/planaria"


def add_daemon_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-dir", help="the daemon's runtime dir (default: "
                        "$PLANARIA_RUNTIME_DIR, $RUNTIME_DIRECTORY, /run/planaria when its "
                        "control socket exists, else STATE_DIR/run)")
    parser.add_argument("--state-dir", help="the daemon's state dir (default: "
                        "$STATE_DIRECTORY or ./.state); locates STATE_DIR/run")
    parser.add_argument("--timeout-s", type=float, default=10.0,
                        help="how long to wait for the daemon's answer (default 10)")
    parser.epilog = EXIT_CODES_HELP


def runtime_dir(args: argparse.Namespace) -> Path:
    if getattr(args, "runtime_dir", None):
        return Path(args.runtime_dir)
    for var in ("PLANARIA_RUNTIME_DIR", "RUNTIME_DIRECTORY"):
        if os.environ.get(var):
            return Path(os.environ[var].split(":")[0])
    if not getattr(args, "state_dir", None) and Path(SYSTEM_RUNTIME_DIR, "control.sock").exists():
        return Path(SYSTEM_RUNTIME_DIR)
    return state_dir(args) / "run"


def state_dir(args: argparse.Namespace) -> Path:
    if getattr(args, "state_dir", None):
        return Path(args.state_dir)
    return Path(os.environ.get("STATE_DIRECTORY", "").split(":")[0] or ".state")


def call(args: argparse.Namespace, command: str, **request_args: Any) -> Any:
    from daemon.control import ControlClient

    client = ControlClient(runtime_dir(args), timeout_s=getattr(args, "timeout_s", 10.0))
    return client.call(command, **request_args)


def fail(name: str, exc: BaseException) -> int:
    """Print why an admin call failed; return its exit code."""
    if isinstance(exc, DaemonNotRunningError):
        print(f"planaria {name}: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    if isinstance(exc, AdminError):
        print(f"planaria {name}: {exc.code.value}: {exc.reason}", file=sys.stderr)
        return EXIT_BY_CODE.get(exc.code, EXIT_INTERNAL)
    if isinstance(exc, ControlProtocolError):
        print(f"planaria {name}: {exc}", file=sys.stderr)
        return EXIT_INTERNAL
    raise exc


def admin_modules() -> dict[str, Any]:
    """name -> command module, for every command with a daemon half (``execute``)."""
    from daemon.cli import _command_modules

    return {mod.NAME: mod for mod in _command_modules() if hasattr(mod, "execute")}
