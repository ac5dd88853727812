"""Socket addresses: the one Unix-socket path limit, endpoint spelling, shared socket names,
owner-only ipc sockets (``bind_private``); and the CurveZMQ settings of the engines' TCP
links to extra clients (below).

Linux's ``sockaddr_un.sun_path`` is 108 bytes with the terminating NUL, so a Unix socket
path may use ``MAX_UNIX_PATH_BYTES`` = 107 bytes (``os.fsencode``: bytes, not characters).
ZMQ fails a longer ``ipc://`` endpoint only at bind or connect time, and obscurely, so every
ipc path of ours goes through ``check_unix_path`` (or ``ipc_endpoint``) first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
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


def bind_private(sock, endpoint: str) -> None:
    """``sock.bind(endpoint)``; an ``ipc://`` socket file is its owner's alone (0600), so
    that no other local user can connect to it (the engines' sockets carry prompts, the
    daemon's take admin requests and heartbeats).

    The mode is set twice: by a umask of 077 around the bind (ZMQ binds an ipc socket in
    the calling thread, so the file never exists with looser bits) and by a chmod after
    it. 077 rather than 177: the umask is the process's, and a directory another thread
    makes meanwhile must stay enterable by its owner."""
    if not endpoint.startswith("ipc://"):
        sock.bind(endpoint)
        return
    path = endpoint[len("ipc://"):]
    old = os.umask(0o077)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    if not path.startswith("@"):  # the abstract namespace has no file
        os.chmod(path, 0o600)


def tcp_endpoint(tcp: str) -> str:
    """``host:port`` -> ``tcp://host:port``; port 0 becomes ``*`` (bind: any free port)."""
    host, sep, port = tcp.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"tcp must be 'host:port', got {tcp!r}")
    return f"tcp://{host}:{'*' if int(port) == 0 else port}"


def ipc_addresses(runtime_dir: str | os.PathLike, client_index: int = 0) -> tuple[str, str]:
    """The (ROUTER, PULL) ipc addresses of frontend ``client_index`` under ``runtime_dir``:
    engines connect to both (engine.client.EngineClient binds them), the supervisor pushes
    ENGINE_CORE_DEAD to the second."""
    base = Path(runtime_dir)
    return (ipc_endpoint(base / f"fe{client_index}-in", "frontend input socket"),
            ipc_endpoint(base / f"fe{client_index}-out", "frontend output socket"))


def frontend_admin_socket_path(runtime_dir: str | os.PathLike, client_index: int = 0) -> Path:
    """Frontend ``client_index``'s admin socket (frontend/admin.py serves it, the daemon calls it)."""
    return check_unix_path(Path(runtime_dir) / f"fe{client_index}-admin", "frontend admin socket")


# -- CurveZMQ on the engines' TCP links to extra clients ----------------------------------
#
# An extra client (``serve --extra-client-addresses tcp://...``) is the CURVE server: its
# ROUTER and PULL carry its secret key. Every engine is a CURVE client of it with the
# daemon's engine key pair, and knows the server's public key. The daemon tells its
# engines (and standbys) where those keys lie through one environment variable holding
# file paths, never key material:
#
#     PLANARIA_ENGINE_CURVE='{"client_key": ".../engine.key_secret",
#                             "servers": {"tcp://10.0.0.5:5555": ".../tool.key"}}'
#
# Key files are ZeroMQ certificates (``planaria keygen NAME``: NAME.key, NAME.key_secret).

ENGINE_CURVE_ENV = "PLANARIA_ENGINE_CURVE"


@dataclass(frozen=True)
class CurveClientKeys:
    """What a CURVE client socket needs: the server's public key and its own pair (z85)."""

    server_key: bytes
    public_key: bytes
    secret_key: bytes


def load_curve_public_key(path: str | os.PathLike) -> bytes:
    """The public key of a certificate file (NAME.key, or NAME.key_secret)."""
    public, _secret = _load_certificate(path)
    return public


def load_curve_keypair(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) from a NAME.key_secret file."""
    public, secret = _load_certificate(path)
    if not secret:
        raise ValueError(f"{path} holds no secret key: give the NAME.key_secret file")
    return public, secret


def _load_certificate(path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    # deferred: zmq.auth (and logging with it) slows the CLI's start; only key files need it
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the CurveZMQ key file {path}: {exc}") from exc
    if not public:
        raise ValueError(f"{path} is not a ZeroMQ certificate (no public key)")
    return public, secret


def engine_curve_env(client_secret_file: str | os.PathLike,
                     server_key_files: Mapping[str, str | os.PathLike]) -> dict[str, str]:
    """The environment entry that gives an engine its CURVE keys (paths only)."""
    spec = {"client_key": os.fspath(client_secret_file),
            "servers": {address: os.fspath(path) for address, path in server_key_files.items()}}
    return {ENGINE_CURVE_ENV: json.dumps(spec)}


def engine_curve_keys(environ: Mapping[str, str] | None = None) -> dict[str, CurveClientKeys]:
    """{address: keys} from ``PLANARIA_ENGINE_CURVE`` (empty without it); the key files
    are read here, once. ``ValueError`` on a bad entry or key file."""
    text = (os.environ if environ is None else environ).get(ENGINE_CURVE_ENV, "")
    if not text:
        return {}
    try:
        spec = json.loads(text)
        client_key, servers = spec["client_key"], dict(spec["servers"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{ENGINE_CURVE_ENV} is not {{'client_key': PATH, 'servers': "
                         f"{{ADDRESS: PATH}}}}: {exc}") from exc
    public, secret = load_curve_keypair(client_key)
    return {address: CurveClientKeys(load_curve_public_key(path), public, secret)
            for address, path in servers.items()}


def set_curve_client(sock, keys: CurveClientKeys) -> None:
    """Make ``sock`` (before connect) a CURVE client of the server holding ``keys.server_key``."""
    sock.curve_serverkey = keys.server_key
    sock.curve_publickey = keys.public_key
    sock.curve_secretkey = keys.secret_key


def set_curve_server(sock, secret_key: bytes) -> None:
    """Make ``sock`` (before bind) a CURVE server with ``secret_key``."""
    sock.curve_server = True
    sock.curve_secretkey = secret_key


class CurveKeySet:
    """ZAP credentials provider (``ThreadAuthenticator.configure_curve_callback``): admit
    exactly these z85 client public keys."""

    def __init__(self, keys: Iterable[bytes | str]) -> None:
        self.keys = frozenset(k.encode() if isinstance(k, str) else bytes(k) for k in keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys
