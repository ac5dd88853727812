"""The ``epoch`` key: read it, and write it only as the current leader (fenced CAS).

``write_epoch`` is a single transaction:

    if   mod_revision(epoch) == expected_mod_revision       (0 when the key is absent)
    and  create_revision(leader) == leader_create_revision  (the writer's fencing token)
    then put(epoch, new_epoch)
    else read epoch and leader, to say which check failed

so a leader whose lease ran out while it was deciding (someone else has won since, or
nobody leads) cannot overwrite the epoch, and two writers racing from the same read
cannot both succeed (elastic/records.py ``fenced_put``, shared with the placement).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from planaria.elastic.errors import EpochConflictError
from planaria.elastic.keys import Epoch, KeyLayout, encode
from planaria.elastic.records import fenced_put, read_record


class EpochStore:
    def __init__(self, client: Any, cluster: str) -> None:
        self._client = client
        self.layout = KeyLayout(cluster)

    def read_epoch(self) -> tuple[Epoch | None, int]:
        """``(epoch, mod_revision)``; ``(None, 0)`` before the first epoch."""
        return read_record(self._client, self.layout.epoch, Epoch, "epoch")

    def write_epoch(self, new_epoch: Epoch, expected_mod_revision: int,
                    leader_create_revision: int, extra_puts: Sequence[tuple[str, bytes]] = ()) -> int:
        """Write ``new_epoch`` (and ``extra_puts``, ``(key, value)`` pairs, in the same
        transaction: an aborted switch's op record and ``desired``); returns its mod revision.

        Raises :class:`StaleLeaderError` if the leader key is gone or belongs to a later
        term, :class:`EpochConflictError` if the epoch changed since it was read (the
        leader check wins when both fail), :class:`EtcdUnavailableError` if etcd is down.
        """
        return fenced_put(self._client, self.layout.epoch, encode(new_epoch),
                          expected_mod_revision=expected_mod_revision, leader_key=self.layout.leader,
                          leader_create_revision=leader_create_revision, conflict=EpochConflictError,
                          what="epoch", extra_puts=extra_puts)
