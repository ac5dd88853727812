"""One record under a key, read with its revision and written fenced by the leader's term.

The epoch and the placement are both written only by the leader, with compare-and-swap:
the key must still be at the mod revision the leader read, and the leader key must still
be of the leader's create revision (its fencing token), in one transaction. A stale
leader loses to the leader check (:class:`StaleLeaderError`) even when the key moved too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from planaria.elastic.errors import RevisionConflictError, StaleLeaderError
from planaria.elastic.etcd_client import etcd_call
from planaria.elastic.keys import decode

T = TypeVar("T", bound=msgspec.Struct)


def read_record(client: Any, key: str, cls: type[T], what: str) -> tuple[T | None, int]:
    """``(record, mod_revision)``; ``(None, 0)`` while the key does not exist."""
    with etcd_call(f"read {what}"):
        value, meta = client.get(key)
    if value is None:
        return None, 0
    return decode(key, value, cls), meta.mod_revision


def fenced_put(client: Any, key: str, value: bytes, *, expected_mod_revision: int, leader_key: str,
               leader_create_revision: int, conflict: type[RevisionConflictError], what: str,
               extra_puts: Sequence[tuple[str, bytes]] = ()) -> int:
    """Put ``value`` (and ``extra_puts``, ``(key, value)`` pairs, in the same transaction)
    if ``key`` is still at ``expected_mod_revision`` and ``leader_key`` still of
    ``leader_create_revision``; returns the key's new mod revision.

    Raises :class:`StaleLeaderError` if the leader key is gone or of a later term,
    ``conflict`` if the key changed since it was read (the leader check wins when both
    fail), :class:`EtcdUnavailableError` if etcd is down."""
    tx = client.transactions
    with etcd_call(f"write {what}"):
        ok, responses = client.transaction(
            compare=[tx.mod(key) == expected_mod_revision,
                     tx.create(leader_key) == leader_create_revision],
            success=[tx.put(key, value), tx.get(key), *(tx.put(k, v) for k, v in extra_puts)],
            failure=[tx.get(key), tx.get(leader_key)])
    if ok:
        return responses[1][0][1].mod_revision
    kvs, leader_kvs = responses
    leader_node, leader_rev = None, 0
    if leader_kvs:
        leader_node = leader_kvs[0][0].decode()
        leader_rev = leader_kvs[0][1].create_revision
    if leader_rev != leader_create_revision:
        raise StaleLeaderError(leader_create_revision, leader_node, leader_rev)
    raise conflict(expected_mod_revision, kvs[0][1].mod_revision if kvs else 0)
