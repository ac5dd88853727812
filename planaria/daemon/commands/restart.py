"""Restart one engine: SIGTERM (it drains its requests), then start it again.

    planaria restart ENGINE

Wire: {"command": "restart", "args": {"engine_id": 1}} -> {"engine_id": 1, "state": ...}.
A drained, failed or backing-off engine starts at once. Errors: UNKNOWN_ENGINE,
CONFLICT (already stopping), UNAVAILABLE (the daemon is shutting down).
"""

from __future__ import annotations

import argparse
from typing import Any

from planaria.daemon.commands._common import add_daemon_arguments, call, fail

NAME = "restart"
HELP = "restart an engine (drain, then start again)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("engine", type=int, metavar="ENGINE", help="engine id (see `planaria status`)")
    add_daemon_arguments(parser)


def execute(supervisor, args: dict[str, Any]) -> dict[str, Any]:
    return supervisor.restart_engine(args.get("engine_id"))


def main(args: argparse.Namespace) -> int:
    try:
        data = call(args, NAME, engine_id=args.engine)
    except Exception as exc:  # noqa: BLE001 - fail() re-raises what it does not know
        return fail(NAME, exc)
    print(f"engine {data['engine_id']}: {data['state']}")
    return 0
