"""HTTP-level guards of the frontend: the API key, the body read, the connection cap.

- ``check_api_key(request, key)``: ``Authorization: Bearer <key>``, compared in constant
  time; AuthenticationError (401) otherwise.
- ``read_body(request, timeout_s, max_bytes)``: the whole body within ``timeout_s`` (a
  client that sends its headers and then trickles the body, slowloris, gets 408 and the
  connection closed) and within ``max_bytes`` (413; a Content-Length over it is refused
  before a byte of the body is read).
- ``CappedTCPSite``: an aiohttp TCPSite that answers a connection beyond
  ``max_connections`` with a 503 and closes it at once, before any handler exists for it;
  the connections already served are untouched. Idle keep-alive connections count (each
  holds a socket), and leave after the keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from aiohttp import web

from planaria.frontend.errors import AuthenticationError, BodyTimeoutError, BodyTooLargeError, error_body


def check_api_key(request: web.Request, api_key: str) -> None:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise AuthenticationError("this server needs an API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
    if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise AuthenticationError("incorrect API key provided", code="invalid_api_key")


async def read_body(request: web.Request, timeout_s: float, max_bytes: int) -> bytes:
    length = request.content_length
    if length is not None and length > max_bytes:
        raise BodyTooLargeError(f"the request body has {length} bytes; the limit is {max_bytes} "
                                "(--max-body-bytes)")
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyTimeoutError(f"the request body did not arrive within {timeout_s:g} s "
                               "(--body-read-timeout-s)", code="body_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise BodyTooLargeError(f"the request body is larger than the limit of {max_bytes} bytes "
                                "(--max-body-bytes)") from None


def _refusal(max_connections: int) -> bytes:
    body = json.dumps(error_body(f"the server holds its maximum of {max_connections} connections "
                                 "(--max-connections); retry later", "service_unavailable_error",
                                 code="too_many_connections")).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class _Refuse(asyncio.Protocol):
    def __init__(self, reply: bytes) -> None:
        self._reply = reply

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self._reply)  # type: ignore[attr-defined]
        transport.close()


class CappedTCPSite(web.TCPSite):
    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int,
                 **kwargs) -> None:
        super().__init__(runner, host, port, **kwargs)
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections = max_connections
        self._reply = _refusal(max_connections)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; TCPSite.start's own part follows
        server = self._runner.server
        if server is None:
            raise RuntimeError("the runner is not set up")

        def protocol() -> asyncio.Protocol:
            if len(server.connections) >= self.max_connections:
                return _Refuse(self._reply)
            return server()

        self._server = await asyncio.get_running_loop().create_server(
            protocol, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port
