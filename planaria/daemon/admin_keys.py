"""CurveZMQ keys for the remote admin socket (`planaria serve --admin-tcp HOST:PORT`).

Files are ZeroMQ certificates as ``zmq.auth.create_certificates`` writes them:
``NAME.key`` holds the public key (safe to copy anywhere), ``NAME.key_secret`` the
public and the secret key (mode 0600). Layout of the daemon's keys directory
(``--admin-keys-dir``, default ``STATE_DIR/admin-keys``, mode 0700)::

    server.key            the daemon's public key: give it to clients (--server-key)
    server.key_secret     made on the first start with --admin-tcp
    authorized/NAME.key   public keys of the clients allowed in (read at each connect)

A client makes its own pair with ``planaria keygen NAME`` and copies ``NAME.key`` into
the daemon's ``authorized/``; it connects with ``--connect tcp://HOST:PORT
--server-key server.key --client-key NAME.key_secret``. Every problem with a key file
raises ``AdminKeyError`` with what to do about it.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq
import zmq.auth

from planaria.daemon.errors import AdminKeyError

SERVER_NAME = "server"
AUTHORIZED_DIR = "authorized"


def make_keypair(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret (0600) in ``directory``; returns their paths.
    Refuses to overwrite an existing pair."""
    if not name or "/" in name or name.startswith("."):
        raise AdminKeyError(f"bad key name {name!r} (a plain file name, e.g. the client's host)")
    directory = Path(directory)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise AdminKeyError(f"{public} or {secret} exists already; not overwriting a key pair")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_path, secret_path = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret_path, 0o600)
    return Path(public_path), Path(secret_path)


def load_public_key(path: str | os.PathLike, what: str = "public key") -> bytes:
    """The public key of a certificate file (either half of a pair)."""
    public, _secret = _load(path, what)
    return public


def load_keypair(path: str | os.PathLike, what: str = "client key") -> tuple[bytes, bytes]:
    """(public, secret) from a NAME.key_secret file."""
    public, secret = _load(path, what)
    if secret is None:
        raise AdminKeyError(f"{what} {path} holds no secret key: give the NAME.key_secret "
                            "file, not NAME.key")
    return public, secret


def _load(path: str | os.PathLike, what: str) -> tuple[bytes, bytes | None]:
    path = Path(path)
    if not path.is_file():
        raise AdminKeyError(f"{what} file {path} does not exist")
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise AdminKeyError(f"{what} file {path} is not a ZeroMQ certificate: {exc}") from exc
    if not public:
        raise AdminKeyError(f"{what} file {path} has no public-key line")
    return public, secret


def server_keypair(keys_dir: str | os.PathLike) -> tuple[bytes, bytes, Path]:
    """The daemon's (public, secret, public key file); made on first use."""
    keys_dir = Path(keys_dir)
    secret_path = keys_dir / f"{SERVER_NAME}.key_secret"
    if not secret_path.exists():
        keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(keys_dir, 0o700)
        make_keypair(keys_dir, SERVER_NAME)
    public, secret = load_keypair(secret_path, "server key")
    return public, secret, keys_dir / f"{SERVER_NAME}.key"


class AuthorizedKeys:
    """ZAP credentials provider: clients whose public key is in ``directory/*.key``.

    The directory is read again at each new connection, so adding or removing a file
    takes effect without a restart (a handful of small files per connect)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    def keys(self) -> set[bytes]:
        found = set()
        for path in sorted(self.directory.glob("*.key")):
            try:
                found.add(load_public_key(path))
            except AdminKeyError:
                continue  # a stray file must not lock everyone out
        return found

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys()


def authorized_keys(keys_dir: str | os.PathLike) -> AuthorizedKeys:
    """The daemon's authorized client keys; at least one must exist."""
    directory = Path(keys_dir) / AUTHORIZED_DIR
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    provider = AuthorizedKeys(directory)
    if not provider.keys():
        raise AdminKeyError(
            f"--admin-tcp needs at least one authorized client key in {directory}: make a "
            f"pair with `planaria keygen NAME` and copy NAME.key there")
    return provider
