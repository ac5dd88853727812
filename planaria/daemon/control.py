"""The supervisor's control socket: admin requests in, one envelope back.

Server: a ZMQ ROUTER bound on ``ipc://<runtime_dir>/control.sock`` (the runtime
directory is created with mode 0700, an existing one is refused when others may write to
it or another user owns it (``ensure_runtime_dir``), the socket file is 0600, and a
``flock`` on ``control.lock`` keeps a second supervisor from stealing the socket), and
optionally on TCP with CurveZMQ. Frames are ``[identity, b"", msgpack(AdminRequest)]`` in
and ``[identity, b"", msgpack(Ok | Err)]`` out, so REQ and DEALER clients both work. The
handler maps ``AdminRequest -> Ok | Err``; whatever it raises becomes an ``Err`` through
``common.errors.to_reply`` (the envelope is ``common.envelope``). No request ends the
server: one over ``MAX_REQUEST_BYTES`` never arrives (ZMQ drops it and the connection:
``zmq.MAXMSGSIZE``), a malformed one (bad framing, undecodable, nested too deeply) is
answered BAD_ARGUMENT or dropped and counted (``num_malformed``), and anything else that
raises while answering is logged and counted (``num_failed``); warnings per request are
rate-limited (``common.logging.should_log``). Two ways to run it:

- from the supervisor's own loop: ``server.poll_once(timeout_ms)`` (or put
  ``server.sockets`` in the loop's ``zmq.Poller`` and call ``poll_once(0)`` when ready);
  the handler then runs on the supervisor's thread;
- in a thread of its own: ``server.start_thread()`` ... ``server.close()``; the handler
  then runs on that thread and must be thread-safe with respect to the supervisor.

Client: ``ControlClient(runtime_dir, timeout_s).call("status", engine=3)``, the one
blocking admin client (``common.admin_client.AdminClient``) aimed at this socket: it returns
the reply's data, raises ``AdminError`` (a subclass per code) for an ``Err``, and
``NotRunningError`` when there is no socket or no answer within the timeout.

TCP: ``ControlServer(..., tcp="host:port", curve_secret_key=..., curve_client_keys=...)``
(keys z85 as made by ``zmq.curve_keypair()``; port 0 picks a free one, see
``tcp_endpoint``). CURVE encrypts and authenticates the server; ``curve_client_keys``,
when given (public keys, or a provider with ``callback(domain, key)`` such as
``daemon.admin_keys.AuthorizedKeys``), also restricts clients to those public keys
(ZAP), which an admin socket should do: the server's public key is not a secret. A TCP
client that gets no answer says why, from its socket's monitor events: the daemon
refused its key (``AuthRefusedError``), the CURVE handshake failed (a wrong server
key), or nothing accepted the connection (``NotRunningError``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Callable, Iterable

import msgspec
import zmq

from planaria.common.admin_client import AdminClient
from planaria.common.envelope import AdminRequest, Err, ErrorCode, Ok, decode_request, encode
from planaria.common.errors import to_reply
from planaria.common.logging import should_log
from planaria.common.sockets import bind_private, ipc_endpoint, tcp_endpoint
from planaria.daemon.errors import DaemonAlreadyRunningError, RuntimeDirError

_log = logging.getLogger(__name__)

SOCKET_NAME = "control.sock"
LOCK_NAME = "control.lock"

MAX_REQUEST_BYTES = 1 << 20  # an admin request is a command and a few arguments
MAX_REQUESTS_PER_POLL = 1000
_MAX_FRAMES_KEPT = 4  # a request has 3 (identity, empty, payload); more are read and dropped

Handler = Callable[[AdminRequest], "Ok | Err"]


def control_socket_path(runtime_dir: str | os.PathLike) -> Path:
    return Path(runtime_dir) / SOCKET_NAME


def ensure_runtime_dir(runtime_dir: str | os.PathLike) -> Path:
    """Create ``runtime_dir`` with mode 0700 if missing. An existing directory (it may be
    systemd's RuntimeDirectory=) is used as it is if this user owns it and nobody else
    may write to it, with a warning when others can enter it (the sockets themselves are
    0600); otherwise ``RuntimeDirError``: whoever can create files there could bind the
    engines' sockets before the frontend does and receive the prompts."""
    path = Path(runtime_dir)
    if not path.exists():
        path.mkdir(mode=0o700, parents=True)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
    elif not path.is_dir():
        raise NotADirectoryError(f"runtime dir is not a directory: {path}")
    info = path.stat()
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.geteuid():
        raise RuntimeDirError(f"runtime dir {path} is owned by uid {info.st_uid}, not by this "
                              f"user (uid {os.geteuid()}): refusing to put the daemon's and the "
                              f"engines' sockets there; use a directory of your own (--runtime-dir)")
    if mode & 0o022:
        raise RuntimeDirError(f"runtime dir {path} has mode {mode:o}: others may create files "
                              f"in it (and pose as the daemon's sockets); refusing it. "
                              f"chmod 700 {path}, or give another --runtime-dir")
    if mode & 0o055:
        _log.warning("runtime dir %s has mode %o; 0700 is expected", path, mode)
    return path


def _recv_message(sock: zmq.Socket) -> list[bytes]:
    """One whole message (``zmq.Again`` if none), keeping at most ``_MAX_FRAMES_KEPT + 1``
    of its frames: the rest are read and dropped (the answer is "malformed" anyway)."""
    frames = [sock.recv(zmq.NOBLOCK)]
    while sock.getsockopt(zmq.RCVMORE):
        frame = sock.recv(zmq.NOBLOCK)  # the parts of a message arrive together
        if len(frames) <= _MAX_FRAMES_KEPT:
            frames.append(frame)
    return frames


class _KeySet:
    """ZAP credentials provider: allow exactly these z85 client public keys."""

    def __init__(self, keys: Iterable[bytes | str]) -> None:
        self.keys = {k.encode() if isinstance(k, str) else bytes(k) for k in keys}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class ControlServer:
    """Binds the control socket(s) on construction; ``close()`` releases everything."""

    def __init__(self, runtime_dir: str | os.PathLike, handler: Handler, *,
                 tcp: str | None = None, curve_secret_key: bytes | None = None,
                 curve_client_keys: Iterable[bytes | str] | None = None) -> None:
        if tcp is not None and curve_secret_key is None:
            raise ValueError("a TCP control socket needs curve_secret_key")
        if curve_client_keys is not None and tcp is None:
            raise ValueError("curve_client_keys only apply to the TCP control socket")
        self.handler = handler
        self.runtime_dir = ensure_runtime_dir(runtime_dir)
        self.socket_path = control_socket_path(self.runtime_dir)
        self.tcp_endpoint: str | None = None
        self._lock_file = self._take_lock()
        self._context = zmq.Context()
        self._auth = None
        self._sockets: list[zmq.Socket] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.num_malformed = 0  # requests that did not decode or had the wrong framing
        self.num_failed = 0  # requests whose answer raised (a bug: logged, left unanswered)
        try:
            self._sockets.append(self._bind_ipc())
            if tcp is not None:
                self._sockets.append(self._bind_tcp(tcp, curve_secret_key, curve_client_keys))
        except BaseException:
            self._release()
            raise
        self._poller = zmq.Poller()
        for sock in self._sockets:
            self._poller.register(sock, zmq.POLLIN)

    # -- setup ----------------------------------------------------------------------------

    def _take_lock(self):
        lock_path = self.runtime_dir / LOCK_NAME
        lock_file = open(lock_path, "a+")  # noqa: SIM115 - held for the server's lifetime
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            lock_file.close()
            raise DaemonAlreadyRunningError(
                f"another planaria daemon holds {lock_path}") from exc
        os.chmod(lock_path, 0o600)
        return lock_file

    def _bind_ipc(self) -> zmq.Socket:
        endpoint = ipc_endpoint(self.socket_path, "control socket")
        sock = self._context.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            bind_private(sock, endpoint)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _bind_tcp(self, tcp: str, secret_key: bytes,
                  client_keys: Iterable[bytes | str] | None) -> zmq.Socket:
        endpoint = tcp_endpoint(tcp)
        if client_keys is not None:
            # deferred: zmq.auth slows the CLI's admin commands (ControlClient lives here too)
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._context)
            self._auth.start()
            provider = client_keys if hasattr(client_keys, "callback") else _KeySet(client_keys)
            self._auth.configure_curve_callback("*", provider)
        sock = self._context.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            sock.curve_server = True
            sock.curve_secretkey = secret_key
            sock.bind(endpoint)
            self.tcp_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    # -- serving --------------------------------------------------------------------------

    @property
    def sockets(self) -> list[zmq.Socket]:
        """The bound sockets, for a caller's own ``zmq.Poller`` (POLLIN)."""
        return list(self._sockets)

    def poll_once(self, timeout_ms: int = 0) -> int:
        """Wait up to ``timeout_ms`` for requests, answer all that are ready; returns how
        many were answered. Not to be mixed with thread mode."""
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("poll_once() while the server runs in its own thread")
        num_answered = 0
        for sock, _event in self._poller.poll(timeout_ms):
            for _ in range(MAX_REQUESTS_PER_POLL):  # a flood must not starve the caller's loop
                try:
                    frames = _recv_message(sock)
                except zmq.Again:
                    break
                try:
                    if self._answer(sock, frames):
                        num_answered += 1
                except Exception:  # noqa: BLE001 - one request never ends the server loop
                    self.num_failed += 1
                    if should_log(self.num_failed):
                        _log.exception("control socket: request #%d failed unanswered", self.num_failed)
        return num_answered

    def start_thread(self, poll_interval_ms: int = 100) -> threading.Thread:
        """Serve from a daemon thread until ``close()``."""
        if self._thread is not None:
            raise RuntimeError("the control server thread is already running")

        def serve() -> None:
            while not self._stop.is_set():
                self.poll_once(poll_interval_ms)

        self._thread = threading.Thread(target=serve, name="planaria-control", daemon=True)
        self._thread.start()
        return self._thread

    def _answer(self, sock: zmq.Socket, frames: list[bytes]) -> bool:
        if len(frames) != 3 or frames[1] != b"":
            self.num_malformed += 1
            if should_log(self.num_malformed):
                _log.warning("dropping control message #%d with %s frames (expected REQ/DEALER "
                             "framing)", self.num_malformed,
                             len(frames) if len(frames) <= _MAX_FRAMES_KEPT else "too many")
            return False
        identity, _, payload = frames
        sock.send_multipart([identity, b"", encode(self.dispatch(payload))])
        return True

    def dispatch(self, payload: bytes) -> Ok | Err:
        """Decode, run the handler, map errors; never raises for a request's fault."""
        try:
            request = decode_request(payload)
        except msgspec.DecodeError as exc:  # the only error it raises, deep nesting included
            self.num_malformed += 1
            return Err("", ErrorCode.BAD_ARGUMENT, f"malformed admin request: {exc}")
        try:
            reply = self.handler(request)
            if not isinstance(reply, (Ok, Err)):
                raise TypeError(f"handler returned {type(reply).__name__}, not Ok or Err")
            if reply.id != request.id:
                reply = msgspec.structs.replace(reply, id=request.id)
            encode(reply)  # fail here, as INTERNAL, if data cannot be encoded
        except Exception as exc:  # noqa: BLE001 - every failure becomes an Err reply
            err = to_reply(request.id, exc)
            if err.code is ErrorCode.INTERNAL:
                _log.exception("admin command %r failed", request.command)
            return err
        return reply

    # -- shutdown -------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._release()

    def _release(self) -> None:
        if self._context.closed:
            return
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets = []
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._context.term()
        if self._lock_file is not None:
            try:
                self.socket_path.unlink(missing_ok=True)
            finally:
                self._lock_file.close()
                self._lock_file = None

    def __enter__(self) -> "ControlServer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ControlClient(AdminClient):
    """The daemon's admin client (the CLI's): the control socket under ``runtime_dir``, or
    its ``--admin-tcp`` socket (``tcp="host:port"``, with ``server_public_key`` and usually
    ``client_keypair``). ``call`` is ``AdminClient.call``."""

    def __init__(self, runtime_dir: str | os.PathLike | None = None, timeout_s: float = 5.0,
                 *, tcp: str | None = None, server_public_key: bytes | None = None,
                 client_keypair: tuple[bytes, bytes] | None = None) -> None:
        if (runtime_dir is None) == (tcp is None):
            raise ValueError("give exactly one of runtime_dir and tcp")
        super().__init__(ipc=control_socket_path(runtime_dir) if runtime_dir is not None else None,
                         tcp=tcp, timeout_s=timeout_s, server_public_key=server_public_key,
                         client_keypair=client_keypair, peer="planaria daemon",
                         socket_name="control socket")
