"""The frontend -> supervisor liveness channel: one ``Beat`` per message.

    frontend PUSH -> supervisor PULL   RUNTIME_DIR/sv-fe   (msgpack Beat, no type frame)

The frontend's event loop sends the beats (frontend/liveness.py); the supervisor's run
loop receives them and its ``FrontendWatch`` judges the silences (daemon/frontend_watch.py).
A beat also carries the frontend's routing figures (``RoutingSummary``: per engine the
blocks of its prefix index and the hits of the requests routed there, the decisions by
reason; docs/routing.md), which `planaria status` shows without asking the frontend
anything. Here, below both: the message and who sent it.

Who sent a beat is taken from the kernel, not from the beat: on Linux ZMQ hands over the
connecting process's ``SO_PEERCRED`` in each message's ``Peer-Address`` property
(``"<addr>:<uid>:<gid>:<pid>"``). ``sender_pid`` refuses a beat whose claimed pid is not
that one, so another local process cannot keep a hung frontend alive by beating in its
name (the runtime dir being 0700 already keeps other users out).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import zmq


MAX_ROUTED_ENGINES = 1024  # engines one routing summary may list
MAX_ROUTE_REASONS = 16


class EngineRouting(msgspec.Struct, array_like=True):
    """One engine in the frontend's router (engine/client.py EngineInfo)."""

    engine: int
    state: Annotated[str, msgspec.Meta(max_length=32)]
    num_cached_blocks: int  # in the frontend's prefix index of it
    num_routed: int  # requests routed to it
    routed_prompt_tokens: int  # their prompt tokens (those that answered)
    routed_cached_tokens: int  # of those, prefix-cache hits in the engine
    num_routed_while_down: int  # sent after its death or drain was known (never)


class RoutingSummary(msgspec.Struct, kw_only=True):
    policy: Annotated[str, msgspec.Meta(max_length=32)]
    decisions: Annotated[dict[Annotated[str, msgspec.Meta(max_length=32)], int],
                         msgspec.Meta(max_length=MAX_ROUTE_REASONS)] = {}
    engines: Annotated[list[EngineRouting], msgspec.Meta(max_length=MAX_ROUTED_ENGINES)] = []

    def to_status(self) -> dict:
        """As `planaria status --json` shows it: engines by index, with their hit rate."""
        return {"policy": self.policy, "decisions": dict(self.decisions), "engines": {str(e.engine): {
            "state": e.state, "num_cached_blocks": e.num_cached_blocks, "num_routed": e.num_routed,
            "routed_prompt_tokens": e.routed_prompt_tokens, "routed_cached_tokens": e.routed_cached_tokens,
            "routed_hit_rate": round(e.routed_cached_tokens / e.routed_prompt_tokens, 4)
            if e.routed_prompt_tokens > 0 else 0.0,
            "num_routed_while_down": e.num_routed_while_down} for e in self.engines}}


class Beat(msgspec.Struct, kw_only=True):
    pid: int
    seq: int  # 0, 1, 2, ... per frontend process
    lag_s: float = 0.0  # how late this beat's timer fired: the loop's latest stall
    timestamp: float = 0.0  # the frontend's time.time(), for logs only
    routing: RoutingSummary | None = None  # the frontend's router, as of this beat


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
