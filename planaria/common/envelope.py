"""The admin protocol's envelope: one request shape, one reply envelope, error codes.

Spoken on the daemon's control socket (daemon/control.py) and on a frontend's admin socket
(frontend/admin.py). Wire form (msgspec msgpack, one frame per message, a ``type`` tag in
each)::

    {"type": "request", "id": "4f2a...", "command": "scale", "args": {"engines": 4}}
    {"type": "ok",  "id": "4f2a...", "data": {...}}
    {"type": "err", "id": "4f2a...", "code": "UNKNOWN_ENGINE", "reason": "no engine 7"}

Exceptions become ``Err`` replies in exactly one place, ``common.errors.to_reply``.
Unknown fields are ignored on decode, so adding an optional field stays compatible.
"""

from __future__ import annotations

import enum
from typing import Any, Union

import msgspec


class ErrorCode(str, enum.Enum):
    """Why an admin request failed. Values are the wire strings."""

    UNKNOWN_COMMAND = "UNKNOWN_COMMAND"  # no such command on this daemon
    BAD_ARGUMENT = "BAD_ARGUMENT"        # malformed request, or an argument out of range
    UNKNOWN_ENGINE = "UNKNOWN_ENGINE"    # the named engine does not exist
    CONFLICT = "CONFLICT"                # another operation is in progress, or state forbids it
    UNAVAILABLE = "UNAVAILABLE"          # cannot be done now (etcd down, shutting down); retry
    INTERNAL = "INTERNAL"                # a bug in the daemon; see its log


class AdminRequest(msgspec.Struct, tag="request", tag_field="type", kw_only=True):
    id: str
    command: str
    args: dict[str, Any] = {}


class Ok(msgspec.Struct, tag="ok", tag_field="type"):
    id: str
    data: Any = None


class Err(msgspec.Struct, tag="err", tag_field="type"):
    id: str
    code: ErrorCode
    reason: str


Reply = Union[Ok, Err]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(AdminRequest)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: AdminRequest | Ok | Err) -> bytes:
    return _encoder.encode(message)


def decode_request(frame: bytes) -> AdminRequest:
    """Raises ``msgspec.DecodeError`` (a ``ValidationError`` for a wrong shape), and only
    that, for any frame: deep nesting included."""
    return _decode(_request_decoder, frame)


def decode_reply(frame: bytes) -> Ok | Err:
    """Raises ``msgspec.DecodeError`` (a ``ValidationError`` for a wrong shape), and only
    that, for any frame: deep nesting included."""
    return _decode(_reply_decoder, frame)


def _decode(decoder: msgspec.msgpack.Decoder, frame: bytes):
    try:
        return decoder.decode(frame)
    except msgspec.DecodeError:
        raise
    except RecursionError as exc:  # msgspec's answer to nesting past the recursion limit
        raise msgspec.DecodeError("message is nested too deeply") from exc
    except Exception as exc:  # noqa: BLE001 - a frame of the wrong kind (not bytes-like), say
        raise msgspec.DecodeError(f"undecodable message: {type(exc).__name__}: {exc}") from exc
