"""The frontend liveness channel (common/liveness.py): the Beat on the wire, and the
sender check that keeps other processes from answering for the frontend (the same check
over real sockets: tests/frontend/test_liveness.py)."""

from __future__ import annotations

import msgspec
import pytest

from planaria.common import liveness


class FakeFrame:
    def __init__(self, peer):
        self.peer = peer

    def get(self, name):
        assert name == "Peer-Address"
        return self.peer


@pytest.mark.parametrize("peer, claimed, expected", [
    ("localhost:1000:1000:41", 41, 41),     # the kernel's pid agrees with the claim
    ("localhost:1000:1000:666", 41, None),  # someone else claims to be the frontend: refused
    ("", 41, 41),                           # no peer credentials on this platform: the claim
    (None, 41, 41),
])
def test_sender_pid_is_the_kernels_when_known(peer, claimed, expected):
    beat = liveness.Beat(pid=claimed, seq=0)
    assert liveness.sender_pid(FakeFrame(peer), beat) == expected


def test_beat_round_trip_and_garbage():
    beat = liveness.Beat(pid=7, seq=3, lag_s=0.5, timestamp=1.0)
    assert liveness.decode(liveness.encode(beat)) == beat
    with pytest.raises(msgspec.DecodeError):
        liveness.decode(b"\x00garbage")
