"""Errors raised by the elastic package.

The tree mirrors torch elastic's ``RendezvousError`` family: one base class, and a
subclass per thing a caller may want to handle differently. Causes are kept with
``raise ... from exc`` so the original gRPC / etcd error is still in the traceback.

    ElasticError
     +-- EtcdError
     |    +-- EtcdUnavailableError   etcd unreachable or too slow; retry later, keep serving
     |    |    +-- EtcdAuthError     etcd refused our credentials or a permission
     |    +-- EtcdStartError         an embedded etcd would not start or become healthy
     |         +-- EtcdAuditError    ... its users or roles are not the ones the daemon made
     +-- RecordDecodeError           a value under /planaria/ is not the struct we expect
     +-- LeadershipError
     |    +-- NotLeaderError         an operation needs leadership this node does not hold
     |    +-- StaleLeaderError       the fencing token no longer matches the leader key
     +-- RevisionConflictError       a leader-written key changed since it was read (CAS lost)
     |    +-- EpochConflictError     ... the epoch
     |    +-- PlacementConflictError ... the placement
     +-- ScaleConflictError          a scale operation is already in progress
"""

from __future__ import annotations


class ElasticError(Exception):
    """Base class for every error of the elastic package."""


class EtcdError(ElasticError):
    """Something went wrong talking to, or running, etcd."""


class EtcdUnavailableError(EtcdError):
    """etcd did not answer within the short RPC timeout (down, partitioned or hung).

    Raised quickly (the client's RPC timeout, about 1.5 s) so the serving path never
    blocks on etcd; background threads retry on their own.
    """

    def __init__(self, operation: str, cause: BaseException | None = None, detail: str | None = None) -> None:
        self.operation = operation
        self.cause = cause
        text = detail if detail is not None else (str(cause) if cause is not None else "")
        super().__init__(f"etcd unavailable during {operation}" + (f": {text}" if text else ""))


class EtcdAuthError(EtcdUnavailableError):
    """etcd refused the user/password, the token, or a permission. A kind of "unavailable"
    (the caller cannot use etcd, serving goes on, background threads retry), with a message
    that says what to fix."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        self.operation = "authenticate"
        self.cause = cause
        Exception.__init__(self, message)


class EtcdStartError(EtcdError):
    """An embedded etcd process exited early or never became healthy."""


class EtcdAuditError(EtcdStartError):
    """The embedded etcd's data directory holds users, roles or permissions the daemon did
    not make (someone got in, or configured it by hand): it is not started."""


class RecordDecodeError(ElasticError):
    """A stored value could not be decoded into the expected struct."""

    def __init__(self, key: str, cause: BaseException | None = None) -> None:
        self.key = key
        super().__init__(f"cannot decode value of {key}: {cause}")


class LeadershipError(ElasticError):
    """Base class for leadership problems."""


class NotLeaderError(LeadershipError):
    """The caller needs to be the cluster leader and is not (or no longer knows it is)."""


class StaleLeaderError(LeadershipError):
    """The writer's fencing token (leader key create revision) is no longer current.

    ``current_leader`` is the node id found in the leader key (None when absent).
    """

    def __init__(self, leader_revision: int, current_leader: str | None,
                 current_revision: int) -> None:
        self.leader_revision = leader_revision
        self.current_leader = current_leader
        self.current_revision = current_revision
        super().__init__(
            f"stale leader: token {leader_revision}, leader key now "
            f"{current_leader!r} at create revision {current_revision}")


class RevisionConflictError(ElasticError):
    """Compare-and-swap on a leader-written key lost: someone wrote it since it was read."""

    what = "record"

    def __init__(self, expected_mod_revision: int, actual_mod_revision: int) -> None:
        self.expected_mod_revision = expected_mod_revision
        self.actual_mod_revision = actual_mod_revision
        super().__init__(
            f"{self.what} changed: expected mod revision {expected_mod_revision}, "
            f"found {actual_mod_revision}")


class EpochConflictError(RevisionConflictError):
    """The epoch changed since it was read."""

    what = "epoch"


class PlacementConflictError(RevisionConflictError):
    """The placement changed since it was read."""

    what = "placement"


class ScaleConflictError(ElasticError):
    """A scale request was refused because another operation has not finished."""

    def __init__(self, op_id: str, phase: str) -> None:
        self.op_id = op_id
        self.phase = phase
        super().__init__(f"scale operation {op_id} still in progress (phase {phase})")
