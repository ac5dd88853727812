"""Building etcd3 clients that fail fast and reconnect fast, and error translation.

Two defaults of python3-etcd3 are wrong for a serving daemon, so clients are built here
(the one place real collaborators are built) rather than with ``etcd3.client()``:

- ``Endpoint.time_retry`` is 300 s: after one UNAVAILABLE the endpoint is marked failed
  and, without failover, every later call raises ``ValueError`` for five minutes even
  when etcd is back. We use ``time_retry=0``.
- gRPC's reconnect backoff grows to 120 s, so a restarted etcd could stay unreached for
  minutes. We cap it at about a second.

Every RPC carries ``timeout_s`` (default 1.5 s), so a down or hung etcd costs a caller at
most that long before :class:`EtcdUnavailableError`.

Secured etcd (``EtcdSecurity``): TLS channels from the CA / client certificate files, and
user/password auth done here rather than by python3-etcd3, whose client authenticates
once in its constructor (so it cannot be built while etcd is down) and never again (so an
expired token fails every call until restart). A gRPC interceptor on each channel puts
the token on every call, authenticates lazily, and on "invalid auth token" (the token
expired, or etcd restarted) authenticates again and retries the call once; a stream that
fails that way is re-authenticated on its next start. Wrong credentials raise
:class:`EtcdAuthError`, a refused TLS handshake an :class:`EtcdUnavailableError` that
says so.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import etcd3
import etcd3.exceptions
import grpc
from etcd3 import etcdrpc

from planaria.elastic.errors import EtcdAuthError, EtcdUnavailableError
from planaria.elastic.etcd_security import EtcdSecurity

DEFAULT_RPC_TIMEOUT_S = 1.5

# gRPC channel options: reconnect quickly after etcd restarts; keep the channel probing.
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]

ClientFactory = Callable[[], Any]  # returns an etcd3 client (MultiEndpointEtcd3Client)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"127.0.0.1:2379"`` or ``"http://host:2379"`` -> ``(host, port)``."""
    text = endpoint.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint must be host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)


def make_client(endpoints: Sequence[str] | str, timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
                security: EtcdSecurity | None = None) -> Any:
    """An etcd3 client to ``endpoints`` with the fixes above; TLS and auth per ``security``
    (an ``https://`` endpoint alone means TLS with the system's CAs)."""
    if isinstance(endpoints, str):
        endpoints = [e for e in endpoints.split(",") if e.strip()]
    if not endpoints:
        raise ValueError("at least one etcd endpoint is required")
    security = security or EtcdSecurity()
    tls = security.tls or any(e.strip().startswith("https://") for e in endpoints)
    creds = None
    if tls:
        creds = grpc.ssl_channel_credentials(security.read("ca_cert"), security.read("key"),
                                             security.read("cert"))
    tokens = _Tokens(security.user, security.password(), timeout_s) if security.auth else None
    eps = []
    for endpoint in endpoints:
        host, port = parse_endpoint(endpoint)
        eps.append(_Endpoint(host, port, secure=tls, creds=creds, time_retry=0,
                             opts=list(_GRPC_OPTIONS), tokens=tokens))
    return etcd3.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout_s,
                                          failover=len(eps) > 1)


def client_factory(endpoints: Sequence[str] | str, timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
                   security: EtcdSecurity | None = None) -> ClientFactory:
    """A zero-argument factory for :func:`make_client` (what Membership takes)."""
    return lambda: make_client(endpoints, timeout_s, security)


# -- auth ------------------------------------------------------------------------------------

_AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"


def _needs_new_token(exc_or_call: Any) -> bool:
    """etcd refused the token itself (expired, revoked, or auth store moved on)."""
    code = exc_or_call.code() if hasattr(exc_or_call, "code") else None
    details = (exc_or_call.details() if hasattr(exc_or_call, "details") else "") or ""
    return code == grpc.StatusCode.UNAUTHENTICATED or (
        code == grpc.StatusCode.INVALID_ARGUMENT and "auth store is old" in details)


class _Tokens:
    """One user's etcd auth token: fetched on first use, fetched again when refused."""

    def __init__(self, user: str, password: str, timeout_s: float) -> None:
        self.user, self._password, self._timeout_s = user, password, timeout_s
        self._lock = threading.Lock()
        self._token: str | None = None
        self.num_authentications = 0

    def get(self, channel: grpc.Channel) -> str:
        with self._lock:
            if self._token is None:
                self._token = self._authenticate(channel)
            return self._token

    def invalidate(self, token: str) -> None:
        with self._lock:
            if self._token == token:
                self._token = None

    def _authenticate(self, channel: grpc.Channel) -> str:
        stub = etcdrpc.AuthStub(channel)
        try:
            resp = stub.Authenticate(etcdrpc.AuthenticateRequest(name=self.user, password=self._password),
                                     timeout=self._timeout_s)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED):
                raise EtcdAuthError(f"etcd refused the credentials of user {self.user!r}: "
                                    f"{exc.details()}", exc) from exc
            raise  # etcd down or unreachable: a transport error like any other
        self.num_authentications += 1
        return resp.token


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                            "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _Stream:
    """A response stream that tells the token holder when etcd refused its token."""

    def __init__(self, call: Any, on_refused: Callable[[], None]) -> None:
        self._call, self._on_refused = call, on_refused

    def __iter__(self) -> "_Stream":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            if _needs_new_token(exc):
                self._on_refused()
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class _AuthInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                       grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, tokens: _Tokens, raw_channel: grpc.Channel) -> None:
        self.tokens, self.raw_channel = tokens, raw_channel

    def _details(self, details: Any) -> tuple[Any, str]:
        token = self.tokens.get(self.raw_channel)
        metadata = [(k, v) for k, v in (details.metadata or ()) if k != "token"] + [("token", token)]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None)), token

    def _unary(self, continuation, details, request):
        for attempt in range(2):
            with_token, token = self._details(details)
            call = continuation(with_token, request)
            if attempt == 0 and call.code() is not None and _needs_new_token(call):
                self.tokens.invalidate(token)  # expired: authenticate again, retry once
                continue
            return call
        return call

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return self._unary(continuation, client_call_details, request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        with_token, _token = self._details(client_call_details)  # an iterator cannot be replayed
        return continuation(with_token, request_iterator)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        with_token, token = self._details(client_call_details)
        return _Stream(continuation(with_token, request), lambda: self.tokens.invalidate(token))

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        with_token, token = self._details(client_call_details)
        return _Stream(continuation(with_token, request_iterator), lambda: self.tokens.invalidate(token))


class _Endpoint(etcd3.Endpoint):
    """An etcd3 endpoint whose channel carries the auth interceptor (when auth is on)."""

    def __init__(self, *args: Any, tokens: _Tokens | None = None, **kwargs: Any) -> None:
        self._tokens = tokens
        super().__init__(*args, **kwargs)

    def _mkchannel(self, opts: Any) -> grpc.Channel:
        raw = super()._mkchannel(opts)
        if self._tokens is None:
            return raw
        return grpc.intercept_channel(raw, _AuthInterceptor(self._tokens, raw))


def num_authentications(client: Any) -> int:
    """How many times ``client`` authenticated (0 without auth): tests see re-auth happen."""
    return sum(ep._tokens.num_authentications for ep in client.endpoints.values()
               if getattr(ep, "_tokens", None) is not None)


# Errors that mean "etcd is not answering" rather than "the request was wrong".
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.NoServerAvailableError,
    etcd3.exceptions.InternalServerError,
    grpc.RpcError,
)


def is_lease_not_found(exc: BaseException) -> bool:
    """True when etcd refused a request because the lease it names is gone."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        details = exc.details() if hasattr(exc, "details") else ""
        return exc.code() == grpc.StatusCode.NOT_FOUND and "lease not found" in (details or "")
    return False


def _rpc_error(exc: BaseException) -> Any:
    """The gRPC error behind ``exc`` (python3-etcd3 re-raises some without their details)."""
    seen = exc
    while seen is not None and not (isinstance(seen, grpc.RpcError) and hasattr(seen, "code")):
        seen = seen.__cause__ or seen.__context__
    return seen


def _describe(exc: BaseException) -> str:
    rpc = _rpc_error(exc)
    if rpc is None:
        return str(exc) or type(exc).__name__
    details = rpc.details() or ""
    text = f"{rpc.code().name}: {details}"
    if any(w in details.lower() for w in ("ssl", "handshake", "certificate", "tls")):
        text += " (TLS handshake refused: check --etcd-ca-cert, --etcd-cert and --etcd-key)"
    return text


@contextlib.contextmanager
def etcd_call(operation: str) -> Iterator[None]:
    """Turn transport failures inside the block into :class:`EtcdUnavailableError`, and
    refused credentials or permissions into :class:`EtcdAuthError`.

    A lease-not-found gRPC error is re-raised as is, so lease owners can re-grant.
    """
    try:
        yield
    except EtcdUnavailableError:
        raise
    except _TRANSPORT_ERRORS as exc:
        if is_lease_not_found(exc):
            raise
        rpc = _rpc_error(exc)
        code = rpc.code() if rpc is not None else None
        details = (rpc.details() or "") if rpc is not None else ""
        if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED) or (
                code == grpc.StatusCode.INVALID_ARGUMENT and "user name is empty" in details):
            raise EtcdAuthError(f"etcd refused {operation}: {details}"
                                + (" (etcd has auth enabled: give --etcd-user and --etcd-password-file)"
                                   if "user name is empty" in details else ""), exc) from exc
        raise EtcdUnavailableError(operation, exc, detail=_describe(exc)) from exc
