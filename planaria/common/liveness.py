"""The frontend -> supervisor liveness channel: one ``Beat`` per message.

    frontend PUSH -> supervisor PULL   RUNTIME_DIR/sv-fe   (msgpack Beat, no type frame)

The frontend's event loop sends the beats (frontend/liveness.py); the supervisor's run
loop receives them and its ``FrontendWatch`` judges the silences (daemon/frontend_watch.py).
Here, below both: the message and who sent it.

Who sent a beat is taken from the kernel, not from the beat: on Linux ZMQ hands over the
connecting process's ``SO_PEERCRED`` in each message's ``Peer-Address`` property
(``"<addr>:<uid>:<gid>:<pid>"``). ``sender_pid`` refuses a beat whose claimed pid is not
that one, so another local process cannot keep a hung frontend alive by beating in its
name (the runtime dir being 0700 already keeps other users out).
"""

from __future__ import annotations

import msgspec
import zmq


class Beat(msgspec.Struct, kw_only=True):
    pid: int
    seq: int  # 0, 1, 2, ... per frontend process
    lag_s: float = 0.0  # how late this beat's timer fired: the loop's latest stall
    timestamp: float = 0.0  # the frontend's time.time(), for logs only


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Beat)


def encode(beat: Beat) -> bytes:
    return _encoder.encode(beat)


def decode(frame: bytes) -> Beat:
    """Raises ``msgspec.DecodeError`` for anything that is not a Beat."""
    return _decoder.decode(frame)


def peer_pid(peer_address: str | None) -> int | None:
    """The pid in a ZMQ ``Peer-Address`` of an ipc:// peer (``"<addr>:<uid>:<gid>:<pid>"``),
    None where the platform gives none."""
    parts = (peer_address or "").rsplit(":", 3)
    return int(parts[3]) if len(parts) == 4 and parts[3].isdigit() else None


def sender_pid(frame: zmq.Frame, beat: Beat) -> int | None:
    """The pid that sent ``beat``: the kernel's, when ZMQ has it, and then only if the beat
    claims the same (None: refused); the beat's own claim where the kernel's is unknown."""
    try:
        kernel = peer_pid(frame.get("Peer-Address"))
    except zmq.ZMQError:  # no such property on this libzmq
        kernel = None
    if kernel is None:
        return beat.pid
    return kernel if kernel == beat.pid else None
