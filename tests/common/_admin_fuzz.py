"""Frames for fuzzing an admin socket (the daemon's control socket, a frontend's admin
socket) from a DEALER: REQ/DEALER framing ``[b"", payload]`` around random bytes, mutated
valid requests and msgpack nested far past msgspec's recursion limit, plus wrong framings."""

from __future__ import annotations

import random

import msgspec

from planaria.common.envelope import AdminRequest, encode

DEEP_LIST = b"\x91" * 100_000 + b"\xc0"


def deep_request(depth: int = 100_000) -> bytes:
    """A well-formed request envelope whose args hold ``depth`` nested lists."""
    head = encode(AdminRequest(id="deep", command="echo", args={}))
    assert head.endswith(b"\xa4args\x80")  # an empty fixmap last: swap it for a deep one
    return head[:-1] + b"\x81\xa1v" + b"\x91" * depth + b"\xc0"


def fuzz_frames(rng: random.Random, num_frames: int):
    valid = encode(AdminRequest(id="v", command="echo", args={"x": 1}))
    for _ in range(num_frames):
        r = rng.random()
        if r < 0.2:  # deep nesting: bare, in a map, inside a good envelope's args
            payload = rng.choice([DEEP_LIST, b"\x81\xa1k" * 50_000 + b"\xc0",
                                  deep_request(rng.choice([1100, 5000, 100_000]))])
        elif r < 0.45:
            payload = rng.randbytes(rng.randrange(0, 80))
        elif r < 0.55:  # schema-invalid msgpack
            payload = msgspec.msgpack.encode(rng.choice([{"type": "request"}, [1, 2], "x", {"id": 3}]))
        else:
            payload = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                payload[rng.randrange(len(payload))] = rng.randrange(256)
            payload = bytes(payload)
        if rng.random() < 0.1:  # wrong framing: no empty delimiter, or extra frames
            yield rng.choice([[payload], [b"x", payload], [b"", payload, b"extra"]])
        else:
            yield [b"", payload]
