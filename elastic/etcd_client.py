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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import etcd3
import etcd3.exceptions
import grpc

from elastic.errors import EtcdUnavailableError

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


def make_client(endpoints: Sequence[str] | str,
                timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> Any:
    """An etcd3 client over plaintext gRPC to ``endpoints`` with the fixes above."""
    if isinstance(endpoints, str):
        endpoints = [e for e in endpoints.split(",") if e.strip()]
    if not endpoints:
        raise ValueError("at least one etcd endpoint is required")
    eps = []
    for endpoint in endpoints:
        host, port = parse_endpoint(endpoint)
        eps.append(etcd3.Endpoint(host, port, secure=False, time_retry=0,
                                  opts=list(_GRPC_OPTIONS)))
    return etcd3.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout_s,
                                          failover=len(eps) > 1)


def client_factory(endpoints: Sequence[str] | str,
                   timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> ClientFactory:
    """A zero-argument factory for :func:`make_client` (what Membership takes)."""
    return lambda: make_client(endpoints, timeout_s)


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


@contextlib.contextmanager
def etcd_call(operation: str) -> Iterator[None]:
    """Turn transport failures inside the block into :class:`EtcdUnavailableError`.

    A lease-not-found gRPC error is re-raised as is, so lease owners can re-grant.
    """
    try:
        yield
    except _TRANSPORT_ERRORS as exc:
        if is_lease_not_found(exc):
            raise
        raise EtcdUnavailableError(operation, exc) from exc
