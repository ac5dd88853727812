"""Envelope round trips and the one exception-to-code mapping."""

from __future__ import annotations

import msgspec
import pytest

from planaria.common import errors
from planaria.common.envelope import (AdminRequest, Err, ErrorCode, Ok, decode_reply, decode_request,
                                      encode)


def test_request_round_trip():
    request = AdminRequest(id="r1", command="scale", args={"engines": 4, "dry_run": True})
    assert decode_request(encode(request)) == request
    assert decode_request(encode(AdminRequest(id="r2", command="status"))).args == {}


@pytest.mark.parametrize("reply", [
    Ok("r1", {"engines": [0, 1]}), Ok("r2"), Err("r3", ErrorCode.UNKNOWN_ENGINE, "no engine 7"),
])
def test_reply_round_trip(reply):
    assert decode_reply(encode(reply)) == reply


def test_wire_form_is_tagged_with_string_codes():
    wire = msgspec.msgpack.decode(encode(Err("r1", ErrorCode.CONFLICT, "busy")))
    assert wire == {"type": "err", "id": "r1", "code": "CONFLICT", "reason": "busy"}
    assert msgspec.msgpack.decode(encode(AdminRequest(id="a", command="c")))["type"] == "request"


@pytest.mark.parametrize("payload", [
    b"\xc1",                                                     # not msgpack
    msgspec.msgpack.encode({"type": "ok", "id": "x"}),           # a reply, not a request
    msgspec.msgpack.encode({"type": "request", "command": "x"}),  # no id
])
def test_bad_requests_raise_decode_error(payload):
    with pytest.raises(msgspec.DecodeError):
        decode_request(payload)


def test_unknown_code_is_rejected():
    payload = msgspec.msgpack.encode({"type": "err", "id": "x", "code": "NOPE", "reason": ""})
    with pytest.raises(msgspec.ValidationError):
        decode_reply(payload)


@pytest.mark.parametrize("exc,code", [
    (errors.UnknownCommandError("no command 'x'"), ErrorCode.UNKNOWN_COMMAND),
    (errors.BadArgumentError("engines must be > 0"), ErrorCode.BAD_ARGUMENT),
    (errors.UnknownEngineError("no engine 7"), ErrorCode.UNKNOWN_ENGINE),
    (errors.ConflictError("a scale-up is running"), ErrorCode.CONFLICT),
    (errors.UnavailableError("etcd is down"), ErrorCode.UNAVAILABLE),
    (errors.InternalError("oops"), ErrorCode.INTERNAL),
    (errors.AdminError(ErrorCode.CONFLICT, "generic"), ErrorCode.CONFLICT),
])
def test_admin_errors_keep_their_code_both_ways(exc, code):
    err = errors.to_reply("r1", exc)
    assert err == Err("r1", code, exc.reason)
    back = errors.from_reply(err)
    assert back.code is code and back.reason == exc.reason
    if type(exc) is not errors.AdminError:
        assert type(back) is type(exc)


def test_validation_error_is_bad_argument():
    class ScaleArgs(msgspec.Struct):
        engines: int

    try:
        msgspec.convert({"engines": "four"}, ScaleArgs)
    except msgspec.ValidationError as exc:
        err = errors.to_reply("r1", exc)
    assert err.code is ErrorCode.BAD_ARGUMENT
    assert "engines" in err.reason


@pytest.mark.parametrize("exc", [
    errors.NotRunningError("the frontend is not running (no admin socket at /r/fe0-admin)"),
    errors.MalformedReplyError("unexpected reply framing from /r/fe0-admin"),
])
def test_a_peer_socket_that_does_not_answer_is_unavailable(exc):
    # The daemon forwards to a frontend's admin socket; it not being there is UNAVAILABLE.
    assert errors.to_reply("r1", exc) == Err("r1", ErrorCode.UNAVAILABLE, str(exc))


def test_other_exceptions_are_internal():
    err = errors.to_reply("r1", KeyError("engine"))
    assert err.code is ErrorCode.INTERNAL
    assert err.reason.startswith("KeyError")


def test_str_is_the_reason():
    exc = errors.UnknownEngineError("no engine 7")
    assert str(exc) == "no engine 7"
    assert "UNKNOWN_ENGINE" in repr(exc)
    assert isinstance(exc, errors.CommonError)
