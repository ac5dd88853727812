"""HTTP-level guards of the frontend: the API key, the body read, the connections.

- ``check_api_key(request, key)``: ``Authorization: Bearer <key>``, compared in constant
  time; AuthenticationError (401) otherwise, also for a header that is not UTF-8 (aiohttp
  hands its bytes over surrogate-escaped; they are compared as the bytes they were).
- ``read_body(request, timeout_s, max_bytes)``: the whole body within ``timeout_s`` (a
  client that sends its headers and then trickles the body, slowloris, gets 408 and the
  connection closed) and within ``max_bytes`` (413; a Content-Length over it is refused
  before a byte of the body is read).
- ``CappedTCPSite``: an aiohttp TCPSite whose every connection passes ``_Connection``, a
  thin protocol in front of aiohttp's RequestHandler:

  - a connection beyond ``max_connections_per_client`` from one IP address is answered
    503 and closed at once, before any handler exists for it. At ``max_connections`` the
    oldest connection that has no request being handled (its head still arriving, or idle
    between requests) is closed to make room (408 if part of a head came); only when every
    connection has a request in progress is the new one answered 503. So connections that
    never finish a head, or sit idle, cannot keep out a client that sends a request; idle
    keep-alive connections count until then (each holds a socket). The per-client cap keeps one
    address from taking every slot; behind a reverse proxy every client has the proxy's
    address, so there set it to 0 (off) and let the proxy bound its clients.
  - the request head (request line and headers) must arrive within
    ``header_read_timeout_s``, counted from the connection's accept and, on a keep-alive
    connection, from the first byte of each later request (an idle keep-alive connection
    is the keep-alive timeout's). Past it the connection is closed: with a 408 when part
    of a head came, silently when nothing did (as aiohttp closes an idle connection; a
    client that races the close retries on a fresh connection, where a 408 would read as
    the answer to its request). Without it, connections that never finish their head hold
    the slots of ``max_connections`` until the keep-alive timeout (75 s), and everyone
    else is refused. The timer stops when aiohttp has parsed the head; a request being
    handled, however long it streams, is never cut by it (bytes of the next head that come
    while it runs get their whole time once it is done). Bytes of a next head that come in
    the same read as the end of the request before are not timed: they wait, as an idle
    connection does, for the keep-alive timeout, unless more bytes come.

  The head timer reads three fields of aiohttp's RequestHandler (``_request_count``,
  ``_messages``, ``_waiter``: aiohttp has no public hook between bytes and requests);
  tests/frontend/test_hostile_http.py fails if a new aiohttp moves them.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from planaria.frontend.errors import AuthenticationError, BodyTimeoutError, BodyTooLargeError, error_body
from planaria.frontend.limits import ServerLimits


def bearer_token(request: web.Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``, or None when there is none."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    token = given.strip()
    return token if scheme.lower() == "bearer" and token else None


def same_key(token: str, key: str) -> bool:
    """Constant-time comparison of the bytes the client sent: aiohttp decodes header bytes
    as UTF-8 with surrogateescape, so encoding back the same way gives them (a plain
    .encode() raised on non-UTF-8 ones)."""
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape"))


def bearer_matches(request: web.Request, key: str) -> bool:
    token = bearer_token(request)
    return token is not None and same_key(token, key)


def check_api_key(request: web.Request, api_key: str) -> None:
    token = bearer_token(request)
    if token is None:
        raise AuthenticationError("this server needs an API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
    if not same_key(token, api_key):
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


def _reply(status: str, message: str, type_: str, code: str, retry_after: bool = False) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, written before (or instead
    of) aiohttp's handler."""
    body = json.dumps(error_body(message, type_, code=code)).encode()
    head = (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            + ("Retry-After: 1\r\n" if retry_after else "") + "Connection: close\r\n\r\n")
    return head.encode() + body


def _client_of(transport: asyncio.BaseTransport) -> str | None:
    """The peer's IP address; None for a socket without one (a Unix socket)."""
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) and peer else None


class CappedTCPSite(web.TCPSite):
    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int,
                 max_connections_per_client: int = ServerLimits.max_connections_per_client,
                 header_read_timeout_s: float = ServerLimits.header_read_timeout_s, **kwargs) -> None:
        super().__init__(runner, host, port, **kwargs)
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if max_connections_per_client < 0 or header_read_timeout_s < 0:
            raise ValueError("max_connections_per_client and header_read_timeout_s must be >= 0 (0: off)")
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        self.header_read_timeout_s = header_read_timeout_s
        self.num_connections = 0
        self._num_by_client: dict[str, int] = {}
        self._open: dict[_Connection, None] = {}  # admitted connections, oldest first
        self._full = _reply("503 Service Unavailable", f"the server holds its maximum of {max_connections} "
                            "connections (--max-connections); retry later", "service_unavailable_error",
                            "too_many_connections", retry_after=True)
        self._client_full = _reply(
            "503 Service Unavailable", f"this client address holds its maximum of {max_connections_per_client} "
            "connections (--max-connections-per-client); reuse them or retry later", "service_unavailable_error",
            "too_many_connections_from_client", retry_after=True)
        self.head_timeout_reply = _reply(
            "408 Request Timeout", f"the request head did not arrive within {header_read_timeout_s:g} s "
            "(--header-read-timeout-s)", "invalid_request_error", "header_timeout")

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; TCPSite.start's own part follows
        if self._runner.server is None:
            raise RuntimeError("the runner is not set up")
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(self), self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    def admit(self, conn: "_Connection", client: str | None) -> bytes | None:
        """Counts a new connection in and returns None, or returns the refusal to send. At
        the cap, the oldest connection with no request being handled (a head still
        arriving, or idle between requests) is closed to make room: connections that
        never finish a head, or sit idle, cannot keep a client that sends a request out."""
        num_mine = self._num_by_client.get(client, 0) if client is not None else 0
        if self.max_connections_per_client and num_mine >= self.max_connections_per_client:
            return self._client_full
        if self.num_connections >= self.max_connections and not self._evict_one():
            return self._full
        self.num_connections += 1
        self._open[conn] = None
        if client is not None:
            self._num_by_client[client] = num_mine + 1
        return None

    def _evict_one(self) -> bool:
        for victim in self._open:  # oldest first; linear in the open connections at worst
            if victim.waiting_for_a_request():
                victim.evict()
                return True
        return False

    def release(self, conn: "_Connection", client: str | None) -> None:
        if self._open.pop(conn, False) is False:
            return  # released already (evicted)
        self.num_connections -= 1
        if client is not None:
            left = self._num_by_client.pop(client) - 1
            if left:
                self._num_by_client[client] = left

    def new_handler(self) -> RequestHandler:
        return self._runner.server()


class _Connection(asyncio.Protocol):
    """One accepted connection: refused, or handed to an aiohttp RequestHandler (every
    transport callback forwarded to it) with the head timer around it."""

    def __init__(self, site: CappedTCPSite) -> None:
        self._site = site
        self._client: str | None = None
        self._handler: RequestHandler | None = None  # once admitted
        self._num_heads = 0  # the handler's parsed requests, as last seen
        # the body (StreamReader) of its latest parsed request while it arrives (held no
        # longer: an unread body would stay in memory), then _body_whole
        self._body = None
        self._body_whole = False  # bytes from here on begin the next request's head
        self._timer: asyncio.TimerHandle | None = None
        self._head_bytes = False  # bytes of the timed head came
        self._was_busy = False  # a request was being handled when the timer last fired

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        client = _client_of(transport)
        refusal = self._site.admit(self, client)
        if refusal is not None:
            transport.write(refusal)  # type: ignore[attr-defined]
            transport.close()
            return
        self._client = client
        self._handler = self._site.new_handler()
        self._handler.connection_made(transport)
        self._start_timer(head_bytes=False)

    def data_received(self, data: bytes) -> None:
        h = self._handler
        if h is None:
            return
        if h._request_count != self._num_heads:  # parsed out of our sight (a paused queue resumed)
            self._saw_heads()
        if self._timer is not None:
            self._head_bytes = True
        elif self._latest_body_whole():
            self._start_timer(head_bytes=True)
        h.data_received(data)
        if h._request_count != self._num_heads:
            self._saw_heads()

    def _saw_heads(self) -> None:
        """aiohttp parsed one or more request heads: the timed one is whole."""
        self._stop_timer()
        h = self._handler
        self._num_heads = h._request_count
        # the newest request is the queue's last; an empty queue (a resumed parser's requests
        # already taken): unknown, and the next bytes are not timed (the keep-alive timeout is)
        self._body = h._messages[-1][1] if h._messages else None
        self._body_whole = False

    def _latest_body_whole(self) -> bool:
        if self._body is not None and self._body.is_eof():
            self._body, self._body_whole = None, True
        return self._body_whole

    def eof_received(self) -> bool | None:
        return self._handler.eof_received() if self._handler is not None else None

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self._handler is not None:
            self._site.release(self, self._client)
            self._handler.connection_lost(exc)
            self._handler = None

    def waiting_for_a_request(self) -> bool:
        """No request is being handled: a head is still arriving, or the connection is idle
        between requests (aiohttp's handler waits for its next message)."""
        h = self._handler
        return (h is not None and h.transport is not None and not h._messages
                and h._waiter is not None and not h._waiter.done())

    def evict(self) -> None:
        """Closed to make room for a new connection (the server is at --max-connections):
        a 408 if part of a head came, else closed as an idle keep-alive connection is."""
        partial_head = self._timer is not None and self._head_bytes
        self._site.release(self, self._client)
        self._stop_timer()
        h = self._handler
        if partial_head:
            h.transport.write(self._site.head_timeout_reply)
        h.force_close()

    # -- the head timer --------------------------------------------------------------------
    def _start_timer(self, head_bytes: bool) -> None:
        if self._site.header_read_timeout_s > 0:
            self._head_bytes = head_bytes
            self._timer = asyncio.get_running_loop().call_later(self._site.header_read_timeout_s, self._expire)

    def _stop_timer(self) -> None:
        self._was_busy = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        h = self._handler
        if h is None or h.transport is None:
            return
        if h._request_count != self._num_heads:  # a head was parsed after all
            self._saw_heads()
            return
        idle = h._waiter is not None and not h._waiter.done()  # aiohttp's own test, for its keep-alive
        if not idle or self._was_busy:
            # a request is being handled (its client sent bytes of the next one early), or was
            # at the last look: the next head gets its whole time from when the handler is free
            self._was_busy = not idle
            self._start_timer(head_bytes=self._head_bytes)
            return
        if self._head_bytes:
            h.transport.write(self._site.head_timeout_reply)
        h.force_close()
