"""The `planaria` executable.

Every subcommand lives in its own module under ``daemon/commands/`` and is found by
discovery, so adding a command never edits this file. A command module defines::

    NAME = "status"                 # the subcommand word
    HELP = "one line for --help"
    def add_arguments(parser): ...  # argparse options
    def main(args) -> int: ...      # CLI half; returns the exit code

Admin commands (those that talk to a running supervisor) also define the daemon half,
``execute(supervisor, request)``, next to the CLI half (see daemon/commands/__init__.py).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import planaria.daemon.commands as commands_pkg


def _command_modules():
    mods = []
    for info in sorted(pkgutil.iter_modules(commands_pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"planaria.daemon.commands.{info.name}")
        if hasattr(mod, "NAME") and hasattr(mod, "main"):
            mods.append(mod)
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="planaria",
        description="Planaria: a fault-tolerant, elastic LLM serving daemon.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _command_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=getattr(mod, "__doc__", None),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_main", None):
        parser.print_help()
        return 2
    try:
        return int(args._main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
