"""Load new weights (same architecture, e.g. a new fine-tune) into the running engines.

    planaria load-weights DIR [--policy hand_over|finish_old|continue_new] [--engine ID] [--version V]
                              [--no-wait] [--wait-timeout-s S]
    planaria load-weights --status [--engine ID]

Each engine checks DIR at once (a directory with config.json of the served architecture
and sizes: anything else is refused, nothing changes), then reads the checkpoint on a
thread of its own while it goes on serving, and swaps it in at a step boundary:
``hand_over`` (default) moves the running requests, with their KV, to engines still on the
old weights (a rolling update, one --engine at a time), then swaps; a request no such
engine can take (every engine loading at once, the last of a rolling update) finishes on
the old weights first, as with ``finish_old`` (new ones wait for the swap);
``continue_new`` swaps at once and recomputes the running requests on the new weights.
Responses carry ``weight_version`` (the checkpoint's content hash, or --version). Without
--no-wait the command waits until every engine applied the weights or failed (a
checkpoint whose tensors do not fit fails there, old weights kept).
An engine that restarts later starts from the serve --model directory again.

Only the frontend holds the engines' sockets, so the supervisor forwards to the
frontend's admin socket (frontend/admin.py; the client is common.admin_client's
``FrontendAdminClient``), which calls each engine. Wire:
{"command": "load-weights", "args": {"action": "load", "model_dir": "/abs/dir",
"policy": "hand_over", "engine_id": null, "version": null}} -> {"engines": {"0":
{"load_id", "state": "reading", ...}}, "errors": {...}, "skipped": {...}};
{"command": "load-weights", "args": {"action": "status", "engine_id": null}} ->
{"engines": {"0": {"state", "version", "model_dir", "load": {...} | null}}}.
Errors: BAD_ARGUMENT (bad directory or checkpoint), UNKNOWN_ENGINE, CONFLICT (a load is
already in progress), UNAVAILABLE (frontend down or slow, no engine running).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from planaria.common.admin_client import FrontendAdminClient
from planaria.common.errors import BadArgumentError, UnavailableError
from planaria.daemon.commands._common import EXIT_BAD_ARGUMENT, add_daemon_arguments, call, fail

NAME = "load-weights"
HELP = "load new weights into the running engines (rolling weight update)"
POLICIES = ("hand_over", "finish_old", "continue_new")
DEFAULT_POLICY = "hand_over"
FRONTEND_TIMEOUT_S = 5.0  # the supervisor's loop waits at most this for the frontend
EXIT_TIMEOUT = 6
POLL_INTERVAL_S = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", metavar="DIR",
                        help="Hugging Face model directory with the new weights")
    parser.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY,
                        help="hand_over (default): running requests move, with their KV, to engines "
                             "still on the old weights (--engine E of a rolling update), then the "
                             "swap; where no such engine is left they finish here first; "
                             "finish_old: they always finish on the old weights first; "
                             "continue_new: swap now, running requests recompute")
    parser.add_argument("--engine", type=int, metavar="ID", help="only this engine (default: all running)")
    parser.add_argument("--version", help="the version to report in responses (default: content hash)")
    parser.add_argument("--no-wait", action="store_true", help="return once the engines accepted the load")
    parser.add_argument("--wait-timeout-s", type=float, default=600.0,
                        help="how long to wait for every engine to apply or fail (default 600)")
    parser.add_argument("--status", action="store_true", help="show each engine's weights and last load")
    add_daemon_arguments(parser)


def execute(supervisor, args: dict[str, Any]) -> dict[str, Any]:
    """Daemon half: validate, then forward to the frontend's admin socket (bounded wait); a
    frontend that is not there or does not answer in time is UNAVAILABLE (``to_reply``)."""
    if supervisor.shutting_down:
        raise UnavailableError("the daemon is shutting down")
    action = args.get("action", "load")
    engine_id = args.get("engine_id")
    if engine_id is not None:
        supervisor.engine(engine_id)  # BAD_ARGUMENT / UNKNOWN_ENGINE
    if supervisor.frontend.child is None:
        raise UnavailableError(f"the frontend is not running ({supervisor.frontend.state.value})")
    frontend = FrontendAdminClient(supervisor.config.runtime_dir, FRONTEND_TIMEOUT_S)
    if action == "status":
        return frontend.call("weight_status", engine_id=engine_id)
    if action != "load":
        raise BadArgumentError(f"action must be 'load' or 'status', got {action!r}")
    model_dir, policy = args.get("model_dir"), args.get("policy", DEFAULT_POLICY)
    if not isinstance(model_dir, str) or not Path(model_dir).is_absolute():
        raise BadArgumentError(f"model_dir must be an absolute path, got {model_dir!r}")
    if not Path(model_dir).is_dir():
        raise BadArgumentError(f"{model_dir} is not a directory")
    if policy not in POLICIES:
        raise BadArgumentError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    supervisor.log.info("weight load requested", model_dir=model_dir, policy=policy, engine_id=engine_id)
    return frontend.call("load_weights", model_dir=model_dir, mode=policy, engine_id=engine_id,
                         version=args.get("version"))


def _print_status(engines: dict[str, dict]) -> None:
    for e, s in engines.items():
        load = s.get("load") or {}
        last = (f"; last load {load.get('load_id')}: {load.get('state')}"
                + (f" ({load['error']})" if load.get("error") else "")) if load else ""
        print(f"engine {e}: {s.get('state')}, weights {s.get('version') or '-'} from "
              f"{s.get('model_dir') or '-'}{last}" + (f"; {s['error']}" if s.get("error") else ""))


def main(args: argparse.Namespace) -> int:
    try:
        if args.status:
            _print_status(call(args, NAME, action="status", engine_id=args.engine)["engines"])
            return 0
        if not args.model_dir:
            print(f"planaria {NAME}: give the model directory (or --status)", file=sys.stderr)
            return EXIT_BAD_ARGUMENT
        model_dir = str(Path(args.model_dir).resolve())  # the engines run in the state dir
        started = call(args, NAME, action="load", model_dir=model_dir, policy=args.policy,
                       engine_id=args.engine, version=args.version)
    except Exception as exc:  # noqa: BLE001 - fail() re-raises what it does not know
        return fail(NAME, exc)
    for e, why in started["errors"].items():
        print(f"engine {e}: refused: {why}", file=sys.stderr)
    for e, state in started["skipped"].items():
        print(f"engine {e}: skipped ({state})", file=sys.stderr)
    loads = {e: d["load_id"] for e, d in started["engines"].items()}
    print(f"reading {model_dir} on engine(s) {', '.join(loads)} ({args.policy})")
    if args.no_wait:
        return 0
    return _wait(args, loads)


def _wait(args: argparse.Namespace, loads: dict[str, str]) -> int:
    """Poll the engines' weight status until each load is applied or failed."""
    deadline = time.monotonic() + args.wait_timeout_s
    done: dict[str, dict] = {}
    while True:
        try:
            status = call(args, NAME, action="status", engine_id=args.engine)["engines"]
        except Exception as exc:  # noqa: BLE001 - fail() re-raises what it does not know
            return fail(NAME, exc)
        for e, load_id in loads.items():
            if e in done:
                continue
            s = status.get(e) or {}
            load = s.get("load") or {}
            if load.get("load_id") == load_id:
                if load.get("state") == "applied":
                    done[e] = load
                    print(f"engine {e}: applied, weight version {load['version']}")
                elif load.get("state") == "failed":
                    done[e] = load
                    print(f"engine {e}: failed, old weights kept: {load['error']}", file=sys.stderr)
            elif s.get("state") in (None, "dead", "stopped", "refused") or "version" in s:
                done[e] = {"state": "lost"}  # it restarted (a fresh engine has no load) or stopped
                print(f"engine {e}: its load is lost ({s.get('state') or 'gone'}; an engine that "
                      "restarts serves the --model weights again)", file=sys.stderr)
        if len(done) == len(loads):
            return 0 if all(d["state"] == "applied" for d in done.values()) else EXIT_BAD_ARGUMENT
        if time.monotonic() >= deadline:
            waiting = sorted(set(loads) - set(done))
            print(f"planaria {NAME}: engine(s) {', '.join(waiting)} not done within "
                  f"{args.wait_timeout_s:g} s (finish_old waits for running requests); "
                  f"see `planaria {NAME} --status`", file=sys.stderr)
            return EXIT_TIMEOUT
        time.sleep(POLL_INTERVAL_S)
