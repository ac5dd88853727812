"""Drain one engine: it finishes its requests, takes no new ones, exits, and stays down.

    planaria drain ENGINE

Wire: {"command": "drain", "args": {"engine_id": 1}} -> {"engine_id": 1, "state":
"stopping"|"drained", "changed": bool}. `planaria restart ENGINE` brings it back;
`planaria scale down` removes engines for good. Errors: UNKNOWN_ENGINE, CONFLICT
(stopping for another reason), UNAVAILABLE (shutting down).
"""

from __future__ import annotations

import argparse
from typing import Any

from planaria.daemon.commands._common import add_daemon_arguments, call, fail

NAME = "drain"
HELP = "drain an engine and keep it down (until `planaria restart`)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("engine", type=int, metavar="ENGINE", help="engine id (see `planaria status`)")
    add_daemon_arguments(parser)


def execute(supervisor, args: dict[str, Any]) -> dict[str, Any]:
    return supervisor.drain_engine(args.get("engine_id"))


def main(args: argparse.Namespace) -> int:
    try:
        data = call(args, NAME, engine_id=args.engine)
    except Exception as exc:  # noqa: BLE001 - fail() re-raises what it does not know
        return fail(NAME, exc)
    note = "" if data["changed"] else " (already)"
    print(f"engine {data['engine_id']}: {data['state']}{note}")
    return 0
