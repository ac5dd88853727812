"""Control socket: real ZMQ sockets over ipc in tmp_path, and CurveZMQ TCP on loopback."""

from __future__ import annotations

import os
import socket
import stat
import threading

import msgspec
import pytest
import zmq

from planaria.common import errors
from planaria.common.envelope import AdminRequest, Err, ErrorCode, Ok, decode_reply, encode
from planaria.daemon.control import ControlClient, ControlServer, control_socket_path
from planaria.daemon.errors import DaemonAlreadyRunningError


def handler(request: AdminRequest) -> Ok | Err:
    if request.command == "echo":
        return Ok(request.id, {"args": request.args, "thread": threading.current_thread().name})
    if request.command == "engine":
        raise errors.UnknownEngineError(f"no engine {request.args['engine_id']}")
    if request.command == "err":
        return Err(request.id, ErrorCode.CONFLICT, "busy")
    if request.command == "crash":
        raise RuntimeError("bug")
    if request.command == "bad-return":
        return {"not": "an envelope"}
    if request.command == "unencodable":
        return Ok(request.id, object())
    if request.command == "wrong-id":
        return Ok("someone-else", 1)
    raise errors.UnknownCommandError(f"unknown command {request.command!r}")


@pytest.fixture
def runtime_dir(tmp_path):
    return tmp_path / "run"


@pytest.fixture
def threaded_server(runtime_dir):
    server = ControlServer(runtime_dir, handler)
    server.start_thread(poll_interval_ms=20)
    yield server
    server.close()


def test_runtime_dir_and_socket_permissions(runtime_dir):
    with ControlServer(runtime_dir, handler):
        assert stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o700
        sock_stat = os.stat(control_socket_path(runtime_dir))
        assert stat.S_ISSOCK(sock_stat.st_mode)
        assert stat.S_IMODE(sock_stat.st_mode) == 0o600
    assert not control_socket_path(runtime_dir).exists()


def test_thread_mode_calls(threaded_server, runtime_dir):
    client = ControlClient(runtime_dir, timeout_s=5.0)
    data = client.call("echo", engine_id=3, command="nested")
    assert data == {"args": {"engine_id": 3, "command": "nested"}, "thread": "planaria-control"}
    assert client.call("wrong-id") == 1


@pytest.mark.parametrize("command,exc_type,code,reason_part", [
    ("engine", errors.UnknownEngineError, ErrorCode.UNKNOWN_ENGINE, "no engine 7"),
    ("err", errors.ConflictError, ErrorCode.CONFLICT, "busy"),
    ("nope", errors.UnknownCommandError, ErrorCode.UNKNOWN_COMMAND, "'nope'"),
    ("crash", errors.InternalError, ErrorCode.INTERNAL, "RuntimeError: bug"),
    ("bad-return", errors.InternalError, ErrorCode.INTERNAL, "not Ok or Err"),
    ("unencodable", errors.InternalError, ErrorCode.INTERNAL, "TypeError"),
])
def test_errors_become_admin_errors(threaded_server, runtime_dir, command, exc_type, code,
                                    reason_part):
    with pytest.raises(exc_type) as info:
        ControlClient(runtime_dir, timeout_s=5.0).call(command, engine_id=7)
    assert info.value.code is code
    assert reason_part in info.value.reason


def test_poll_once_from_the_callers_loop(runtime_dir):
    with ControlServer(runtime_dir, handler) as server:
        assert server.poll_once(0) == 0
        result = {}

        def call():
            result["data"] = ControlClient(runtime_dir, timeout_s=5.0).call("echo", x=1)

        caller = threading.Thread(target=call)
        caller.start()
        answered = 0
        while caller.is_alive() and answered == 0:
            answered += server.poll_once(50)
        caller.join(timeout=5.0)
        assert answered == 1
        assert result["data"]["args"] == {"x": 1}
        assert result["data"]["thread"] == threading.current_thread().name


def test_sockets_can_join_the_callers_poller(runtime_dir):
    with ControlServer(runtime_dir, handler) as server:
        poller = zmq.Poller()
        for sock in server.sockets:
            poller.register(sock, zmq.POLLIN)
        req = zmq.Context.instance().socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        try:
            req.connect(f"ipc://{control_socket_path(runtime_dir)}")
            req.send(encode(AdminRequest(id="r1", command="echo")))
            assert poller.poll(5000)
            assert server.poll_once(0) == 1
            assert req.poll(5000)
            reply = decode_reply(req.recv())
        finally:
            req.close()
        assert isinstance(reply, Ok) and reply.id == "r1"


def test_malformed_request_gets_bad_argument(runtime_dir):
    with ControlServer(runtime_dir, handler) as server:
        reply = server.dispatch(b"\xc1 definitely not msgpack")
        assert reply.code is ErrorCode.BAD_ARGUMENT
        reply = server.dispatch(msgspec.msgpack.encode({"type": "request", "id": "x"}))
        assert isinstance(reply, Err) and reply.code is ErrorCode.BAD_ARGUMENT


def test_no_socket_means_not_running(runtime_dir):
    with pytest.raises(errors.NotRunningError) as info:
        ControlClient(runtime_dir, timeout_s=1.0).call("status")
    assert str(info.value) == (f"planaria daemon is not running (no control socket at "
                               f"{control_socket_path(runtime_dir)})")


def test_socket_without_answer_means_not_running(runtime_dir):
    # A socket file nobody serves (a supervisor that was SIGKILLed leaves one behind).
    with ControlServer(runtime_dir, handler):
        client = ControlClient(runtime_dir, timeout_s=0.3)
        with pytest.raises(errors.NotRunningError) as info:
            client.call("echo")  # bound but never polled
    assert "no answer" in str(info.value) and "within 0.3s" in str(info.value)


def test_second_server_is_refused_and_stale_socket_is_replaced(runtime_dir):
    with ControlServer(runtime_dir, handler):
        with pytest.raises(DaemonAlreadyRunningError):
            ControlServer(runtime_dir, handler)
    control_socket_path(runtime_dir).touch()  # stale file left by a dead supervisor
    server = ControlServer(runtime_dir, handler)
    server.start_thread(poll_interval_ms=20)
    try:
        assert ControlClient(runtime_dir, timeout_s=5.0).call("echo")["args"] == {}
    finally:
        server.close()


def test_existing_runtime_dir_is_kept(tmp_path):
    runtime_dir = tmp_path / "existing"
    runtime_dir.mkdir(mode=0o755)
    os.chmod(runtime_dir, 0o755)
    with ControlServer(runtime_dir, handler):
        assert stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o755
        assert stat.S_IMODE(os.stat(control_socket_path(runtime_dir)).st_mode) == 0o600


def test_too_long_socket_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="too long"):
        ControlServer(tmp_path / ("x" * 120), handler)


@pytest.mark.parametrize("kwargs", [
    dict(tcp="127.0.0.1:0"),                          # TCP without CURVE
    dict(curve_client_keys=[b"k"]),                   # client keys without TCP
    dict(tcp="no-port", curve_secret_key=b"k" * 40),
])
def test_server_argument_errors(runtime_dir, kwargs):
    with pytest.raises(ValueError):
        ControlServer(runtime_dir, handler, **kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(runtime_dir="r", tcp="127.0.0.1:1"), dict(tcp="127.0.0.1:1"),
    dict(runtime_dir="r", timeout_s=0),
])
def test_client_argument_errors(kwargs):
    with pytest.raises(ValueError):
        ControlClient(**kwargs)


# -- TCP with CurveZMQ -------------------------------------------------------------------


@pytest.fixture
def server_keys():
    return zmq.curve_keypair()


def tcp_server(runtime_dir, secret, client_keys=None) -> ControlServer:
    server = ControlServer(runtime_dir, handler, tcp="127.0.0.1:0", curve_secret_key=secret,
                           curve_client_keys=client_keys)
    server.start_thread(poll_interval_ms=20)
    return server


def tcp_address(server: ControlServer) -> str:
    return server.tcp_endpoint.removeprefix("tcp://")


def test_curve_tcp_call(runtime_dir, server_keys):
    public, secret = server_keys
    server = tcp_server(runtime_dir, secret)
    try:
        client = ControlClient(tcp=tcp_address(server), server_public_key=public, timeout_s=5.0)
        assert client.call("echo", n=1)["args"] == {"n": 1}
        with pytest.raises(errors.UnknownEngineError):
            client.call("engine", engine_id=2)
        # The ipc socket keeps working alongside.
        assert ControlClient(runtime_dir, timeout_s=5.0).call("echo")["args"] == {}
    finally:
        server.close()


def test_curve_wrong_server_key_says_so(runtime_dir, server_keys):
    _public, secret = server_keys
    wrong_public, _ = zmq.curve_keypair()
    server = tcp_server(runtime_dir, secret)
    try:
        client = ControlClient(tcp=tcp_address(server), server_public_key=wrong_public,
                               timeout_s=0.5)
        with pytest.raises(errors.AuthRefusedError, match="--server-key is not the public key"):
            client.call("echo")
    finally:
        server.close()


def test_curve_nothing_listening_is_not_running(server_keys):
    public, _ = server_keys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = ControlClient(tcp=f"127.0.0.1:{port}", server_public_key=public, timeout_s=0.5)
    with pytest.raises(errors.NotRunningError, match="connection not accepted"):
        client.call("echo")


def test_curve_client_allow_list(runtime_dir, server_keys):
    public, secret = server_keys
    allowed = zmq.curve_keypair()
    stranger = zmq.curve_keypair()
    server = tcp_server(runtime_dir, secret, client_keys=[allowed[0]])
    try:
        ok_client = ControlClient(tcp=tcp_address(server), server_public_key=public,
                                  client_keypair=allowed, timeout_s=5.0)
        assert ok_client.call("echo")["args"] == {}
        stranger_client = ControlClient(tcp=tcp_address(server), server_public_key=public,
                                        client_keypair=stranger, timeout_s=0.5)
        with pytest.raises(errors.AuthRefusedError, match="refused this client's key"):
            stranger_client.call("echo")
    finally:
        server.close()


def test_fuzz_random_and_deeply_nested_requests_never_stop_the_server(threaded_server, runtime_dir):
    """Real sockets, the server on its own thread (as the supervisor's loop runs it):
    noise, mutated requests and msgpack nested past msgspec's recursion limit are answered
    BAD_ARGUMENT or dropped, and a well-formed call still gets its answer."""
    import random

    from tests.common._admin_fuzz import DEEP_LIST, deep_request, fuzz_frames

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"ipc://{control_socket_path(runtime_dir)}")
        for payload, why in ((DEEP_LIST, "Expected `object`"), (deep_request(), "nested too deeply")):
            dealer.send_multipart([b"", payload])  # each answered, and told why
            assert dealer.poll(10_000), "no answer: the server loop ended"
            _, reply = dealer.recv_multipart()
            reply = decode_reply(reply)
            assert isinstance(reply, Err) and reply.code is ErrorCode.BAD_ARGUMENT
            assert why in reply.reason, reply.reason
        for frames in fuzz_frames(random.Random(4321), 600):
            dealer.send_multipart(frames)
        # the same socket still gets answers, after everything sent before
        dealer.send_multipart([b"", encode(AdminRequest(id="last", command="echo", args={"n": 1}))])
        deadline = 60_000
        while True:
            assert dealer.poll(deadline), "no answer to the last request"
            frames = dealer.recv_multipart()
            try:
                reply = decode_reply(frames[-1])
            except msgspec.DecodeError:
                continue
            if reply.id == "last":
                break
        assert isinstance(reply, Ok) and reply.data["args"] == {"n": 1}
    finally:
        dealer.close(0)
    assert threaded_server._thread.is_alive()
    assert threaded_server.num_malformed > 10
    assert ControlClient(runtime_dir, timeout_s=10.0).call("echo", x=2)["args"] == {"x": 2}
