"""Make a CurveZMQ key pair: for the remote admin socket (`planaria serve --admin-tcp`)
or for a frontend client on a tcp:// `--extra-client-addresses` (docs/operations.md).

    planaria keygen NAME [--dir DIR]

Writes DIR/NAME.key (the public key) and DIR/NAME.key_secret (mode 0600). A client
keeps NAME.key_secret and passes it as --client-key; NAME.key goes into the daemon's
admin-keys/authorized/ directory (STATE_DIR/admin-keys/authorized/ by default), which
the daemon reads at every new connection. For an extra client, the client keeps
NAME.key_secret and the daemon gets NAME.key as --extra-client-server-key. Nothing is
overwritten. No daemon involved.
"""

from __future__ import annotations

import argparse
import sys

from planaria.daemon.commands._common import EXIT_BAD_ARGUMENT
from planaria.daemon.errors import AdminKeyError

NAME = "keygen"
HELP = "make a CurveZMQ key pair (remote admin socket, tcp:// extra clients)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the key's name, e.g. this host's (NAME.key, NAME.key_secret)")
    parser.add_argument("--dir", default=".", help="where to write the pair (default: here)")


def main(args: argparse.Namespace) -> int:
    from planaria.daemon.admin_keys import make_keypair  # deferred: zmq.auth slows the CLI's start

    try:
        public, secret = make_keypair(args.dir, args.name)
    except (AdminKeyError, OSError) as exc:
        print(f"planaria keygen: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGUMENT
    print(f"public key:  {public}  (copy it into the daemon's admin-keys/authorized/)")
    print(f"secret key:  {secret}  (keep it; pass it as --client-key)")
    return 0
