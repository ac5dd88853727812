"""Shared pieces of the admin commands' CLI halves: finding the daemon, exit codes.

Exit codes of every admin command (also listed in `planaria --help` epilogs):
0 done; 1 internal error; 2 bad argument (also a missing or bad key file); 3 daemon not
running; 4 unknown engine; 5 conflict (another operation in progress, or the state
forbids it); 6 unavailable (e.g. shutting down); 7 unknown command (the daemon is older
than this CLI); 8 refused (the daemon's TCP admin socket did not accept this client's
CurveZMQ keys).

The daemon is found through its ipc control socket (``--runtime-dir``, or the defaults
below), or remotely with ``--connect tcp://HOST:PORT --server-key FILE --client-key
FILE`` (see daemon/admin_keys.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from planaria.common.envelope import ErrorCode
from planaria.common.errors import AdminError, AuthRefusedError, MalformedReplyError, NotRunningError
from planaria.daemon.cli import _command_modules
from planaria.daemon.errors import AdminKeyError

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_ARGUMENT, EXIT_NOT_RUNNING = 0, 1, 2, 3
EXIT_REFUSED = 8
EXIT_BY_CODE = {ErrorCode.INTERNAL: 1, ErrorCode.BAD_ARGUMENT: 2, ErrorCode.UNKNOWN_ENGINE: 4,
                ErrorCode.CONFLICT: 5, ErrorCode.UNAVAILABLE: 6, ErrorCode.UNKNOWN_COMMAND: 7}
EXIT_CODES_HELP = ("exit codes: 0 done, 1 internal error, 2 bad argument, 3 daemon not "
                   "running, 4 unknown engine, 5 conflict, 6 unavailable, 7 unknown command, "
                   "8 refused (keys)")
SYSTEM_RUNTIME_DIR = "/run/planaria"


def add_daemon_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runtime-dir", help="the daemon's runtime dir (default: "
                        "$PLANARIA_RUNTIME_DIR, $RUNTIME_DIRECTORY, /run/planaria when its "
                        "control socket exists, else STATE_DIR/run)")
    parser.add_argument("--state-dir", help="the daemon's state dir (default: "
                        "$STATE_DIRECTORY or ./.state); locates STATE_DIR/run")
    parser.add_argument("--timeout-s", type=float, default=10.0,
                        help="how long to wait for the daemon's answer (default 10)")
    remote = parser.add_argument_group("remote daemon (TCP with CurveZMQ)")
    remote.add_argument("--connect", metavar="tcp://HOST:PORT",
                        help="the daemon's --admin-tcp socket instead of the local ipc one")
    remote.add_argument("--server-key", metavar="FILE",
                        help="the daemon's public key (its STATE_DIR/admin-keys/server.key)")
    remote.add_argument("--client-key", metavar="FILE",
                        help="this client's NAME.key_secret (`planaria keygen NAME`), whose "
                             "NAME.key is in the daemon's admin-keys/authorized/")
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


def client(args: argparse.Namespace):
    """A ControlClient for the daemon ``args`` name (raises AdminKeyError for bad keys)."""
    # deferred: control pulls structlog and asyncio, admin_keys zmq.auth; the CLI must start fast
    from planaria.daemon.admin_keys import load_keypair, load_public_key
    from planaria.daemon.control import ControlClient

    timeout_s = getattr(args, "timeout_s", 10.0)
    connect = getattr(args, "connect", None)
    if not connect:
        if getattr(args, "server_key", None) or getattr(args, "client_key", None):
            raise AdminKeyError("--server-key and --client-key go with --connect tcp://HOST:PORT")
        return ControlClient(runtime_dir(args), timeout_s=timeout_s)
    scheme, sep, where = connect.partition("://")
    if not sep or scheme != "tcp":
        raise AdminKeyError(f"--connect wants tcp://HOST:PORT, got {connect!r}")
    if not args.server_key:
        raise AdminKeyError("--connect needs --server-key FILE: the daemon's public key "
                            "(STATE_DIR/admin-keys/server.key on its host)")
    if not args.client_key:
        raise AdminKeyError("--connect needs --client-key FILE: this client's NAME.key_secret "
                            "(make one with `planaria keygen NAME`; copy NAME.key into the "
                            "daemon's admin-keys/authorized/)")
    server = load_public_key(args.server_key, "--server-key")
    pair = load_keypair(args.client_key, "--client-key")
    try:
        return ControlClient(tcp=where, server_public_key=server, client_keypair=pair,
                             timeout_s=timeout_s)
    except ValueError as exc:
        raise AdminKeyError(f"--connect {connect}: {exc}") from exc


def call(args: argparse.Namespace, command: str, **request_args: Any) -> Any:
    return client(args).call(command, **request_args)


def fail(name: str, exc: BaseException) -> int:
    """Print why an admin call failed; return its exit code."""
    if isinstance(exc, NotRunningError):
        print(f"planaria {name}: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    if isinstance(exc, AdminError):
        print(f"planaria {name}: {exc.code.value}: {exc.reason}", file=sys.stderr)
        return EXIT_BY_CODE.get(exc.code, EXIT_INTERNAL)
    if isinstance(exc, AdminKeyError):
        print(f"planaria {name}: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGUMENT
    if isinstance(exc, AuthRefusedError):
        print(f"planaria {name}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if isinstance(exc, MalformedReplyError):
        print(f"planaria {name}: {exc}", file=sys.stderr)
        return EXIT_INTERNAL
    raise exc


def admin_modules() -> dict[str, Any]:
    """name -> command module, for every command with a daemon half (``execute``)."""
    return {mod.NAME: mod for mod in _command_modules() if hasattr(mod, "execute")}
