"""Print the planaria version, and the running daemon's when one answers.

    planaria version

Wire: {"command": "version", "args": {}} -> {"version": "0.1.0", "pid": 1234}.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from planaria.daemon.commands._common import add_daemon_arguments, call
from planaria.common.errors import CommonError, NotRunningError
from planaria.daemon.errors import DaemonError

NAME = "version"
HELP = "print the CLI's and the running daemon's version"


def version() -> str:
    # deferred: importlib.metadata (about 40 modules) slows the CLI's start
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("planaria")
    except PackageNotFoundError:
        return "unknown"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_daemon_arguments(parser)
    parser.set_defaults(timeout_s=2.0)


def execute(supervisor, args: dict[str, Any]) -> dict[str, Any]:
    return {"version": version(), "pid": os.getpid()}


def main(args: argparse.Namespace) -> int:
    print(f"planaria {version()}")
    try:
        data = call(args, NAME)
    except NotRunningError:
        print("daemon: not running")
        return 0
    except (DaemonError, CommonError) as exc:  # a bad key file, refused keys, an Err: say so
        print(f"daemon: unknown ({exc})")
        return 0
    print(f"daemon: planaria {data['version']} (pid {data['pid']})")
    return 0
