"""Show the output of the daemon's children (kept in STATE_DIR/logs/).

    planaria logs [--engine E | --frontend] [-n N] [--follow]

Without --engine/--frontend, every child's last N lines, each file under a header.
Wire: {"command": "logs", "args": {}} -> {"files": {"frontend": PATH, "engine-0": PATH,
...}}. When no daemon answers, the files under --state-dir (or ./.state) are read.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from planaria.common.errors import NotRunningError, UnknownEngineError
from planaria.daemon.commands._common import (EXIT_BAD_ARGUMENT, add_daemon_arguments, call, fail,
                                     state_dir)

NAME = "logs"
HELP = "show the frontend's and engines' output (-n N lines, --follow)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--engine", type=int, metavar="E", help="only engine E")
    who.add_argument("--frontend", action="store_true", help="only the frontend")
    parser.add_argument("-n", "--lines", type=int, default=50, help="last N lines (default 50)")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    add_daemon_arguments(parser)


def log_files(log_dir: Path, engine_ids) -> dict[str, str]:
    files = {"frontend": str(log_dir / "frontend.log")}
    files.update({f"engine-{i}": str(log_dir / f"engine-{i}.log") for i in engine_ids})
    return files


def execute(supervisor, args: dict[str, Any]) -> dict[str, Any]:
    from planaria.daemon.launch import log_dir  # deferred: launch (subprocess, ctypes) slows the CLI's start

    return {"files": log_files(log_dir(supervisor.config), sorted(supervisor.engines))}


def _tail(path: Path, n: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return list(deque(f, maxlen=n)) if n > 0 else []
    except FileNotFoundError:
        return []


def _follow(paths: dict[str, Path], prefix: bool) -> None:
    handles = {}
    for name, path in paths.items():
        try:
            f = open(path, errors="replace")  # noqa: SIM115 - closed at exit
        except FileNotFoundError:
            continue
        f.seek(0, os.SEEK_END)
        handles[name] = f
    while True:
        quiet = True
        for name, f in handles.items():
            for line in f:
                quiet = False
                sys.stdout.write(f"{name}| {line}" if prefix else line)
        sys.stdout.flush()
        if quiet:
            time.sleep(0.25)


def main(args: argparse.Namespace) -> int:
    if args.lines < 0:
        print("planaria logs: -n must be >= 0", file=sys.stderr)
        return EXIT_BAD_ARGUMENT
    if getattr(args, "connect", None):
        print("planaria logs: reads the daemon's log files, so it runs on the daemon's host "
              "(not with --connect); remotely, use journalctl or ship the files", file=sys.stderr)
        return EXIT_BAD_ARGUMENT
    try:
        files = call(args, NAME)["files"]
    except NotRunningError:
        logs = state_dir(args) / "logs"
        ids = sorted(int(p.stem.split("-", 1)[1]) for p in logs.glob("engine-*.log")
                     if p.stem.split("-", 1)[1].isdigit())
        files = {k: v for k, v in log_files(logs, ids).items() if Path(v).exists()}
        if not files:
            print(f"planaria logs: daemon not running and no logs under {logs}", file=sys.stderr)
            return 3
    except Exception as exc:  # noqa: BLE001 - fail() re-raises what it does not know
        return fail(NAME, exc)
    if args.engine is not None:
        key = f"engine-{args.engine}"
        if key not in files:
            return fail(NAME, UnknownEngineError(f"no engine {args.engine} "
                                                 f"(logs: {', '.join(sorted(files))})"))
        files = {key: files[key]}
    elif args.frontend:
        files = {"frontend": files["frontend"]}
    paths = {name: Path(p) for name, p in files.items()}
    single = len(paths) == 1
    for name, path in paths.items():
        if not single:
            print(f"==> {name} ({path}) <==")
        sys.stdout.writelines(_tail(path, args.lines))
    if args.follow:
        try:
            _follow(paths, prefix=not single)
        except KeyboardInterrupt:
            return 0
    return 0
