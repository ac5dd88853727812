"""The one blocking admin client: a request out, the reply's data (or an exception) back.

    AdminClient(ipc=path, timeout_s=5.0).call("status", engine_id=3)
    AdminClient(tcp="host:port", server_public_key=..., client_keypair=...).call("status")

Frames are ``[b"", msgpack(AdminRequest)]`` out and ``[b"", msgpack(Ok | Err)]`` back on a
fresh DEALER socket per call (no REQ state to wedge), so any ROUTER that answers with REQ
framing serves it: the daemon's control socket (daemon/control.py; the CLI reaches it
through ``daemon.control.ControlClient``) and a frontend's admin socket (frontend/admin.py;
the daemon reaches it through ``FrontendAdminClient``).

``call`` returns the reply's data, raises ``AdminError`` (a subclass per code) for an
``Err``, ``NotRunningError`` when there is no socket or no answer within the timeout, and
``MalformedReplyError`` for a reply that is not an envelope. Over TCP (the daemon's
``--admin-tcp``, CurveZMQ) a call that gets no answer says why, from its socket's monitor
events: the daemon refused its key (``AuthRefusedError``), the CURVE handshake failed (a
wrong server key), or nothing accepted the connection (``NotRunningError``).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import msgspec
import zmq

from planaria.common.envelope import AdminRequest, Err, Ok, decode_reply, encode
from planaria.common.errors import AuthRefusedError, MalformedReplyError, NotRunningError, from_reply
from planaria.common.sockets import check_unix_path, frontend_admin_socket_path, tcp_endpoint


class AdminClient:
    """One request per ``call``, each on a fresh DEALER socket (no REQ state to wedge).

    ``peer`` and ``socket_name`` name the other side in error messages ("planaria daemon
    is not running (no control socket at ...)")."""

    def __init__(self, *, ipc: str | os.PathLike | None = None, tcp: str | None = None,
                 timeout_s: float = 5.0, server_public_key: bytes | None = None,
                 client_keypair: tuple[bytes, bytes] | None = None,
                 peer: str = "planaria daemon", socket_name: str = "control socket") -> None:
        if (ipc is None) == (tcp is None):
            raise ValueError("give exactly one of ipc and tcp")
        if tcp is not None and server_public_key is None:
            raise ValueError("a TCP admin client needs server_public_key")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.peer, self.socket_name = peer, socket_name
        self.socket_path: Path | None = check_unix_path(ipc, socket_name) if ipc is not None else None
        self._endpoint = f"ipc://{self.socket_path}" if self.socket_path is not None else tcp_endpoint(tcp)
        self._server_public_key = server_public_key
        self._client_keypair = client_keypair

    @property
    def where(self) -> str:
        return str(self.socket_path) if self.socket_path is not None else self._endpoint

    def call(self, command: str, /, **args: Any) -> Any:
        """Run ``command`` on the peer and return the reply's data."""
        if self.socket_path is not None and not self.socket_path.exists():
            raise NotRunningError(
                f"{self.peer} is not running (no {self.socket_name} at {self.socket_path})")
        request = AdminRequest(id=uuid.uuid4().hex, command=command, args=args)
        payload = encode(request)  # raises TypeError for arguments msgpack cannot carry
        context = zmq.Context.instance()
        sock = context.socket(zmq.DEALER)
        monitor = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if self._server_public_key is not None:
                public, secret = self._client_keypair or zmq.curve_keypair()
                sock.curve_serverkey = self._server_public_key
                sock.curve_publickey = public
                sock.curve_secretkey = secret
                monitor = sock.get_monitor_socket()
            sock.connect(self._endpoint)
            sock.send_multipart([b"", payload])
            reply = self._receive(sock, request.id, monitor)
        finally:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
        if isinstance(reply, Err):
            raise from_reply(reply)
        return reply.data

    def _receive(self, sock: zmq.Socket, request_id: str,
                 monitor: zmq.Socket | None = None) -> Ok | Err:
        if not sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
            if monitor is not None:
                self._explain_silence(monitor)
            raise NotRunningError(
                f"{self.peer} is not running (no answer on the {self.socket_name} at "
                f"{self.where} within {self.timeout_s:g}s)")
        frames = sock.recv_multipart()
        if len(frames) != 2 or frames[0] != b"":
            raise MalformedReplyError(f"unexpected reply framing from {self.where}")
        try:
            reply = decode_reply(frames[1])
        except msgspec.DecodeError as exc:
            raise MalformedReplyError(f"malformed reply from {self.where}: {exc}") from exc
        # A fresh socket per call sees only its own reply; "" answers a malformed request.
        if reply.id not in (request_id, ""):
            raise MalformedReplyError(f"reply {reply.id} does not answer {request_id}")
        return reply

    def _explain_silence(self, monitor: zmq.Socket) -> None:
        """No reply over TCP+CURVE: raise what the socket's monitor events say happened."""
        # deferred: zmq.utils.monitor imports asyncio; the CLI must start fast
        from zmq.utils.monitor import recv_monitor_message

        seen = set()
        while monitor.poll(0):
            seen.add(recv_monitor_message(monitor)["event"])
        if zmq.EVENT_HANDSHAKE_FAILED_AUTH in seen:
            raise AuthRefusedError(
                f"the daemon at {self.where} refused this client's key (CurveZMQ): its "
                f"public key (the --client-key pair's NAME.key) is not in the daemon's "
                f"admin-keys/authorized/ directory")
        if seen & {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL}:
            raise AuthRefusedError(
                f"CurveZMQ handshake with {self.where} failed: --server-key is not the "
                f"public key of the daemon listening there (its STATE_DIR/admin-keys/server.key)")
        if zmq.EVENT_CONNECTED not in seen:
            raise NotRunningError(
                f"{self.peer} is not running at {self.where} (connection not accepted "
                f"within {self.timeout_s:g}s)")


class FrontendAdminClient(AdminClient):
    """Frontend ``client_index``'s admin socket under ``runtime_dir`` (the daemon's side of
    ``planaria load-weights``); an absent or silent frontend raises ``NotRunningError``,
    which ``to_reply`` answers as ``UNAVAILABLE``."""

    def __init__(self, runtime_dir: str | os.PathLike, timeout_s: float, client_index: int = 0) -> None:
        super().__init__(ipc=frontend_admin_socket_path(runtime_dir, client_index), timeout_s=timeout_s,
                         peer="the frontend", socket_name="admin socket")
