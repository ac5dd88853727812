"""Add or remove engine replicas.

    planaria scale up [--by N] [--wait]
    planaria scale down [--by N] [--wait]
    planaria scale to N [--wait]

Wire: {"command": "scale", "args": {"action": "to", "engines": 3}} (or "up"/"down" with
"by") -> {"engines": 2, "target": 3, "changed": true, "op_id": 1, "adding": [2],
"removing": []}. A scale-up engine starts with the smallest kv_cache_bytes of the
running engines, so it skips memory profiling (its kv_source is "reused"); a
scale-down drains the departing engines (highest ids first) before they exit. With
--wait the command returns when the operation is done (engines serving / gone).

Errors, each changing nothing: BAD_ARGUMENT (a count below 1 or above the daemon's
--max-engines), CONFLICT (another scale operation is in progress), UNAVAILABLE
(shutting down).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from daemon.commands._common import EXIT_BAD_ARGUMENT, add_daemon_arguments, call, fail
from daemon.errors import BadArgumentError

NAME = "scale"
HELP = "add or remove engine replicas: scale up|down [--by N], scale to N"


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "to"], help="direction, or an absolute count")
    parser.add_argument("count", nargs="?", type=_count, metavar="N",
                        help="engine count (for `to`)")
    parser.add_argument("--by", type=_count, default=None, help="engines to add or remove (default 1)")
    parser.add_argument("--wait", action="store_true", help="return when the operation is done")
    parser.add_argument("--wait-timeout-s", type=float, default=600.0,
                        help="give up waiting after this long (default 600)")
    add_daemon_arguments(parser)


def execute(supervisor, args: dict[str, Any]) -> dict[str, Any]:
    action = args.get("action")
    if action == "to":
        return supervisor.scale_to(args.get("engines"))
    if action not in ("up", "down"):
        raise BadArgumentError(f"scale action must be up, down or to, got {action!r}")
    by = args.get("by", 1)
    if isinstance(by, bool) or not isinstance(by, int) or by < 1:
        raise BadArgumentError(f"--by must be a whole number >= 1, got {by!r}")
    current = len(supervisor.engines)
    return supervisor.scale_to(current + by if action == "up" else current - by)


def _request(args: argparse.Namespace) -> dict[str, Any] | str:
    if args.action == "to":
        if args.count is None:
            return "scale to needs N"
        if args.by is not None:
            return "scale to takes N, not --by"
        return {"action": "to", "engines": args.count}
    if args.count is not None:
        return f"scale {args.action} takes --by N, not a count"
    return {"action": args.action, "by": 1 if args.by is None else args.by}


def _wait(args: argparse.Namespace, op_id: int, target: int) -> int:
    deadline = time.monotonic() + args.wait_timeout_s
    while time.monotonic() < deadline:
        status = call(args, "status")
        scale = status.get("scale")
        if scale is None or scale["op_id"] != op_id:
            states = {e["engine_id"]: e["state"] for e in status["engines"]}
            print(f"done: {status['num_up']}/{status['num_engines']} engines up "
                  f"({', '.join(f'{k}={v}' for k, v in states.items())})")
            return 0 if status["num_engines"] == target else 1
        time.sleep(0.25)
    print(f"planaria scale: still in progress after {args.wait_timeout_s:g}s", file=sys.stderr)
    return 1


def main(args: argparse.Namespace) -> int:
    request = _request(args)
    if isinstance(request, str):
        print(f"planaria scale: {request}", file=sys.stderr)
        return EXIT_BAD_ARGUMENT
    try:
        data = call(args, NAME, **request)
        if not data["changed"]:
            print(f"already {data['engines']} engines")
            return 0
        print(f"scaling {data['engines']} -> {data['target']} engines (op {data['op_id']}; "
              f"adding {data['adding']}, removing {data['removing']})")
        return _wait(args, data["op_id"], data["target"]) if args.wait else 0
    except Exception as exc:  # noqa: BLE001 - fail() re-raises what it does not know
        return fail(NAME, exc)
