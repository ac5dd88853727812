"""The embedded etcd's root credential: made once per state directory, auth enabled with it.

``planaria serve --parallel ep`` without ``--etcd-endpoints`` runs its own etcd; anyone who
can reach its client port (loopback, or ``--etcd-listen``'s address for other nodes) could
otherwise rewrite the cluster's epoch, placement and desired size. So:

- ``root_credential(etcd_dir)``: ``<etcd_dir>/root.password`` holds a random password
  (created with mode 0600, never rewritten: a restart of the daemon or of etcd on the same
  state directory reuses it); returns the ``EtcdSecurity`` (user ``root`` and that file)
  that the daemon and its engines use (engines get the path and the user name through
  their environment, never the password: elastic/etcd_security.py);
- ``enable_root_auth(endpoint, password)``: if etcd still answers an unauthenticated
  request (auth off: a fresh data directory, or a first start that stopped half-way), add
  the ``root`` role and user with that password (or set it), grant the role, enable auth.
  Idempotent; no password on any command line (gRPC, not etcdctl).

Other nodes joining over ``--etcd-listen`` pass ``--etcd-user root --etcd-password-file``
with a copy of that file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import grpc
from etcd3 import etcdrpc

from planaria.elastic.errors import EtcdStartError
from planaria.elastic.etcd_security import EtcdSecurity

ROOT_USER = "root"
PASSWORD_FILE = "root.password"
_RPC_TIMEOUT_S = 5.0


def root_credential(etcd_dir: str | os.PathLike[str]) -> EtcdSecurity:
    """The root user and its password file under ``etcd_dir``, made (0600) if missing."""
    directory = Path(etcd_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / PASSWORD_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        os.chmod(path, 0o600)  # someone loosened it: only the daemon's user reads it
    return EtcdSecurity(user=ROOT_USER, password_file=str(path))


def auth_enabled(endpoint: str) -> bool:
    """Whether etcd refuses an unauthenticated read (raises EtcdStartError if unreachable)."""
    with grpc.insecure_channel(endpoint) as channel:
        try:
            etcdrpc.KVStub(channel).Range(etcdrpc.RangeRequest(key=b"\0", limit=1), timeout=_RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            if _refused(exc):
                return True
            raise EtcdStartError(f"etcd at {endpoint} did not answer: {exc.code().name}: {exc.details()}") from exc
    return False


def enable_root_auth(endpoint: str, password: str) -> bool:
    """Turn auth on with user ``root`` / ``password`` unless it is on; True if it turned it on."""
    if auth_enabled(endpoint):
        return False
    with grpc.insecure_channel(endpoint) as channel:
        auth = etcdrpc.AuthStub(channel)
        try:
            _exists_ok(lambda: auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name=ROOT_USER), timeout=_RPC_TIMEOUT_S))
            try:
                auth.UserAdd(etcdrpc.AuthUserAddRequest(name=ROOT_USER, password=password), timeout=_RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                if "already exists" not in (exc.details() or ""):
                    raise
                auth.UserChangePassword(etcdrpc.AuthUserChangePasswordRequest(name=ROOT_USER, password=password),
                                        timeout=_RPC_TIMEOUT_S)
            auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=ROOT_USER, role=ROOT_USER),
                               timeout=_RPC_TIMEOUT_S)
            auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=_RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise EtcdStartError(f"cannot enable auth on the embedded etcd at {endpoint}: "
                                 f"{exc.code().name}: {exc.details()}") from exc
    return True


def _exists_ok(call) -> None:
    try:
        call()
    except grpc.RpcError as exc:
        if "already exists" not in (exc.details() or ""):
            raise


def _refused(exc: grpc.RpcError) -> bool:
    details = exc.details() or ""
    return exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
        exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "user name is empty" in details)
