"""The ``epoch`` key: read it, and write it only as the current leader (fenced CAS).

``write_epoch`` is a single transaction:

    if   mod_revision(epoch) == expected_mod_revision       (0 when the key is absent)
    and  create_revision(leader) == leader_create_revision  (the writer's fencing token)
    then put(epoch, new_epoch)
    else read epoch and leader, to say which check failed

so a leader whose lease ran out while it was deciding (someone else has won since, or
nobody leads) cannot overwrite the epoch, and two writers racing from the same read
cannot both succeed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elastic.errors import EpochConflictError, StaleLeaderError
from elastic.etcd_client import etcd_call
from elastic.keys import Epoch, KeyLayout, decode, encode


class EpochStore:
    def __init__(self, client: Any, cluster: str) -> None:
        self._client = client
        self.layout = KeyLayout(cluster)

    def read_epoch(self) -> tuple[Epoch | None, int]:
        """``(epoch, mod_revision)``; ``(None, 0)`` before the first epoch."""
        with etcd_call("read epoch"):
            value, meta = self._client.get(self.layout.epoch)
        if value is None:
            return None, 0
        return decode(self.layout.epoch, value, Epoch), meta.mod_revision

    def write_epoch(self, new_epoch: Epoch, expected_mod_revision: int,
                    leader_create_revision: int, extra_puts: Sequence[tuple[str, bytes]] = ()) -> int:
        """Write ``new_epoch`` (and ``extra_puts``, ``(key, value)`` pairs, in the same
        transaction: an aborted switch's op record and ``desired``); returns its mod revision.

        Raises :class:`StaleLeaderError` if the leader key is gone or belongs to a later
        term, :class:`EpochConflictError` if the epoch changed since it was read (the
        leader check wins when both fail), :class:`EtcdUnavailableError` if etcd is down.
        """
        epoch_key, leader_key = self.layout.epoch, self.layout.leader
        tx = self._client.transactions
        with etcd_call("write epoch"):
            ok, responses = self._client.transaction(
                compare=[tx.mod(epoch_key) == expected_mod_revision,
                         tx.create(leader_key) == leader_create_revision],
                success=[tx.put(epoch_key, encode(new_epoch)), tx.get(epoch_key),
                         *(tx.put(k, v) for k, v in extra_puts)],
                failure=[tx.get(epoch_key), tx.get(leader_key)])
        if ok:
            return responses[1][0][1].mod_revision
        epoch_kvs, leader_kvs = responses
        leader_node, leader_rev = None, 0
        if leader_kvs:
            leader_node = leader_kvs[0][0].decode()
            leader_rev = leader_kvs[0][1].create_revision
        if leader_rev != leader_create_revision:
            raise StaleLeaderError(leader_create_revision, leader_node, leader_rev)
        actual = epoch_kvs[0][1].mod_revision if epoch_kvs else 0
        raise EpochConflictError(expected_mod_revision, actual)
