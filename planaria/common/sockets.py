"""Socket addresses: the one Unix-socket path limit, endpoint spelling, shared socket names.

Linux's ``sockaddr_un.sun_path`` is 108 bytes with the terminating NUL, so a Unix socket
path may use ``MAX_UNIX_PATH_BYTES`` = 107 bytes (``os.fsencode``: bytes, not characters).
ZMQ fails a longer ``ipc://`` endpoint only at bind or connect time, and obscurely, so every
ipc path of ours goes through ``check_unix_path`` (or ``ipc_endpoint``) first.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_UNIX_PATH_BYTES = 107  # sun_path is 108 bytes on Linux, NUL included


def check_unix_path(path: str | os.PathLike, what: str = "socket") -> Path:
    """``path`` as a Path; ``ValueError`` when it is too long for a Unix socket."""
    num_bytes = len(os.fsencode(path))
    if num_bytes > MAX_UNIX_PATH_BYTES:
        raise ValueError(f"{what} path is too long for AF_UNIX ({num_bytes} > "
                         f"{MAX_UNIX_PATH_BYTES} bytes): {path}; use a shorter runtime dir")
    return Path(path)


def ipc_endpoint(path: str | os.PathLike, what: str = "socket") -> str:
    """``ipc://<path>``, after ``check_unix_path``."""
    return f"ipc://{check_unix_path(path, what)}"


def tcp_endpoint(tcp: str) -> str:
    """``host:port`` -> ``tcp://host:port``; port 0 becomes ``*`` (bind: any free port)."""
    host, sep, port = tcp.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"tcp must be 'host:port', got {tcp!r}")
    return f"tcp://{host}:{'*' if int(port) == 0 else port}"


def frontend_admin_socket_path(runtime_dir: str | os.PathLike, client_index: int = 0) -> Path:
    """Frontend ``client_index``'s admin socket (frontend/admin.py serves it, the daemon calls it)."""
    return check_unix_path(Path(runtime_dir) / f"fe{client_index}-admin", "frontend admin socket")
