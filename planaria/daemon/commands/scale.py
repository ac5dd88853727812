"""Add or remove engine replicas.

    planaria scale up [--by N] [--wait]
    planaria scale down [--by N] [--wait]
    planaria scale to N [--wait]

Wire: {"command": "scale", "args": {"action": "to", "engines": 3}} (or "up"/"down" with
"by") -> {"engines": 2, "target": 3, "changed": true, "op_id": 1, "adding": [2],
"removing": []}. A scale-up engine starts with the smallest kv_cache_bytes of the
running engines, so it skips memory profiling (its kv_source is "reused"); a
scale-down drains the departing engines (highest ids first) before they exit. With
--wait the command shows each engine's state as it changes (starting, running with its
KV figure, stopping, gone; the EP record's state and the EP operation's phase in
expert-parallel mode) and returns when the operation is done, with a closing line and
exit 0 when every engine serves (1 if the target was not reached). Without --wait it
prints what it started; `planaria scale to N --wait` for the same N follows an operation
already under way.

Expert-parallel mode (--parallel ep): the count is the cluster's, on any node: the
command writes etcd's ``desired`` (the reply's op_id is the EP op's, adding/removing are
empty), the leader places the engines over the nodes and each node's supervisor starts
or removes its share; `up`/`down` start from the cluster's count. The newest request
wins: one made while another is under way supersedes it (that op ends "cancelled",
superseded by the new one, whose target the cluster then follows). --wait shows the
placement and the other nodes' engines too, and ends when its EP op is over, with exit 0
when the group has the target's ranks, all serving (1 when it was superseded or failed).

Errors, each changing nothing: BAD_ARGUMENT (a count below 1 or above the daemon's
--max-engines; in EP mode, the sum of the nodes' --max-engines), CONFLICT (replica mode:
another scale operation is in progress), UNAVAILABLE (shutting down; in EP mode, etcd
unreachable).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from planaria.common.errors import BadArgumentError
from planaria.daemon.commands._common import EXIT_BAD_ARGUMENT, add_daemon_arguments, call, fail
from planaria.daemon.commands.status import _fmt_bytes

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
    current = supervisor.engine_count()
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


# -- progress display (pure: status replies in, lines out) --------------------------------

_FINAL_PHASES = ("done", "failed", "cancelled")


def engine_label(e: dict[str, Any]) -> str:
    """One engine's state as the progress display shows it: the supervisor's state, the
    EP record's (loading, serving, ...) when there is one, the KV figure once it serves,
    and the reason of a backoff or failure."""
    label = e["state"]
    if e.get("ep_state"):
        label += f" (ep {e['ep_state']}" + (f", rank {e['rank']}" if e.get("rank") is not None else "") + ")"
    if e["state"] == "running" and e.get("kv_source"):
        label += f", kv {e['kv_source']} {_fmt_bytes(e.get('kv_cache_bytes'))}"
    if e["state"] in ("backoff", "failed") and e.get("reason"):
        label += f": {e['reason']}"
    return label


def progress_view(status: dict[str, Any]) -> dict[str, str]:
    """What the display tracks: "engine N" -> its label, and "op" -> the EP op's phase; in
    EP mode also the placement and the other nodes' engines ("engine ID" -> its record)."""
    view = {f"engine {e['engine_id']}": engine_label(e) for e in status["engines"]}
    ep = status.get("ep") or {}
    if ep.get("placement"):
        view["placement"] = ", ".join(f"{n}: {c}" for n, c in sorted(ep["placement"].items()))
    for eid, rec in sorted((ep.get("engines") or {}).items()):
        if rec.get("node_id") and rec["node_id"] != ep.get("node_id"):
            view[f"engine {eid}"] = f"ep {rec['state']}" + (f", rank {rec['rank']}" if rec.get("rank") is not None
                                                            and rec.get("epoch") == ep.get("epoch") else "")
    ep_op = ep.get("op")
    if ep_op:
        progress = f" ({ep_op['progress']})" if ep_op.get("progress") else ""
        view["op"] = f"ep op {ep_op['op_id']} to {ep_op['target']}: {ep_op['phase']}{progress}"
    return view


def render_changes(before: dict[str, str] | None, after: dict[str, str]) -> list[str]:
    """A line per tracked item that appeared or changed, and per engine that went away."""
    before = before or {}
    lines = [f"{key}: {label}" if key != "op" else label
             for key, label in after.items() if before.get(key) != label]
    lines += [f"{key}: gone" for key in before if key not in after and key != "op"]
    return lines


def _own_ep_op(status: dict[str, Any], op_id: int | str | None) -> dict[str, Any] | None:
    """The EP op ``op_id`` from the status (active, last, or among the recent ops)."""
    ep = status.get("ep") or {}
    for op in (ep.get("op"), ep.get("last_op"), (ep.get("ops") or {}).get(op_id)):
        if op and op_id is not None and op.get("op_id") == op_id:
            return op
    return None


def finished(status: dict[str, Any], op_id: int | str) -> bool:
    """The supervisor's op ``op_id`` is over, and the EP op (``op_id`` itself when the
    status lists it: it may have been superseded) is no longer under way."""
    scale = status.get("scale")
    if scale is not None and scale["op_id"] == op_id:
        return False
    own = _own_ep_op(status, op_id)
    if own is not None:
        return own["phase"] in _FINAL_PHASES
    ep_op = (status.get("ep") or {}).get("op")
    return ep_op is None or ep_op["phase"] in _FINAL_PHASES


def render_final(status: dict[str, Any], target: int, elapsed_s: float,
                 op_id: int | str | None = None) -> tuple[str, bool]:
    """The closing line, and whether the operation reached its target. An EP op that failed
    or was superseded is named with its reason (``op_id``'s own record when the status has
    it: a finished op is no longer the active one)."""
    up, total = status["num_up"], status["num_engines"]
    ep = status.get("ep") or {}
    ep_op = _own_ep_op(status, op_id) or ep.get("op")
    if ep_op and ep_op["phase"] in ("failed", "cancelled"):
        why = ep_op.get("error") or ep_op.get("progress")
        return (f"scale to {target} {ep_op['phase']} after {elapsed_s:.1f}s "
                f"(ep op {ep_op['op_id']}{': ' + why if why else ''}); {up}/{total} engines up"), False
    if "world_size" in ep:  # EP: the cluster's group, not this node's engines, says it
        records = ep.get("engines") or {}
        serving = [r for r in ep["ranks"] if (records.get(r) or {}).get("state") == "serving"]
        placed = ", ".join(f"{n}: {c}" for n, c in sorted((ep.get("placement") or {}).items()))
        if ep["world_size"] == target and len(serving) == target:
            return f"done: {target} engines serving ({elapsed_s:.1f}s)" + (f"; placed {placed}" if placed else ""), True
        return (f"scale to {target} ended after {elapsed_s:.1f}s with {len(serving)}/{ep['world_size']} "
                f"rank(s) serving in epoch {ep.get('epoch')}" + (f"; placed {placed}" if placed else "")), False
    if total == target and up == target:
        return f"done: {target} engines serving ({elapsed_s:.1f}s)", True
    bad = [f"engine {e['engine_id']} {engine_label(e)}" for e in status["engines"]
           if e["state"] != "running"]
    return (f"scale to {target} ended after {elapsed_s:.1f}s with {up}/{total} engines up"
            + (f": {'; '.join(bad)}" if bad else "")), False


def render_started(data: dict[str, Any]) -> str:
    """What a scale request started, and how to follow it."""
    parts = []
    if data["adding"]:
        parts.append(f"starting engine{'s' * (len(data['adding']) > 1)} "
                     f"{', '.join(map(str, data['adding']))}")
    if data["removing"]:
        parts.append(f"draining engine{'s' * (len(data['removing']) > 1)} "
                     f"{', '.join(map(str, data['removing']))}")
    return (f"scaling {data['engines']} -> {data['target']} engines (op {data['op_id']}): "
            f"{'; '.join(parts) or 'in progress'}")


def _wait(args: argparse.Namespace, op_id: int, target: int) -> int:
    started = time.monotonic()
    deadline = started + args.wait_timeout_s
    view = None
    while True:
        status = call(args, "status")
        new_view = progress_view(status)
        for line in render_changes(view, new_view):
            print(f"  {line}", flush=True)
        view = new_view
        if finished(status, op_id):
            line, ok = render_final(status, target, time.monotonic() - started, op_id)
            print(line)
            return 0 if ok else 1
        if time.monotonic() >= deadline:
            print(f"planaria scale: still in progress after {args.wait_timeout_s:g}s "
                  f"(follow it with `planaria status`)", file=sys.stderr)
            return 1
        time.sleep(0.25)


def main(args: argparse.Namespace) -> int:
    request = _request(args)
    if isinstance(request, str):
        print(f"planaria scale: {request}", file=sys.stderr)
        return EXIT_BAD_ARGUMENT
    try:
        if args.wait and request["action"] == "to":  # an operation to N under way: follow it
            status = call(args, "status")
            scale, ep_op = status.get("scale"), (status.get("ep") or {}).get("op")
            if scale is not None and scale["target"] == request["engines"]:
                print(f"following scale op {scale['op_id']} to {scale['target']} engines")
                return _wait(args, scale["op_id"], scale["target"])
            if ep_op is not None and ep_op["target"] == request["engines"]:
                print(f"following ep op {ep_op['op_id']} to {ep_op['target']} engines")
                return _wait(args, ep_op["op_id"], ep_op["target"])
        data = call(args, NAME, **request)
        if not data["changed"]:
            print(f"already {data['engines']} engines")
            return 0
        print(render_started(data))
        if not args.wait:
            print(f"follow it with `planaria scale to {data['target']} --wait` or `planaria status`")
            return 0
        return _wait(args, data["op_id"], data["target"])
    except Exception as exc:  # noqa: BLE001 - fail() re-raises what it does not know
        return fail(NAME, exc)
