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
  Idempotent; no password on any command line (gRPC, not etcdctl);
- ``audit_auth(endpoint, password)``, at every start: auth is on, root's password is the
  file's, and the users and roles are exactly the ones made here (user ``root`` with role
  ``root``, role ``root`` with no key permissions of its own: etcd gives it every right).
  Anything else (``audit_problems`` lists it) raises ``EtcdAuditError``: the daemon refuses
  to start rather than removing what it finds, since whoever added a user may have
  written keys too; the message says how to look (etcdctl) and what to remove.

Each takes ``ca_cert`` (PEM bytes) for an etcd served over TLS (elastic/etcd_pki.py).
Other nodes joining over ``--etcd-listen`` pass ``--etcd-user root --etcd-password-file``
with a copy of that file (and ``--etcd-ca-cert`` with a copy of its CA).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import grpc
from etcd3 import etcdrpc

from planaria.elastic.errors import EtcdAuditError, EtcdStartError
from planaria.elastic.etcd_security import EtcdSecurity

ROOT_USER = "root"
PASSWORD_FILE = "root.password"
_RPC_TIMEOUT_S = 5.0
EXPECTED_USERS = {ROOT_USER: [ROOT_USER]}  # user -> its roles
EXPECTED_ROLES = {ROOT_USER: []}  # role -> its key permissions (root needs none)


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


def _channel(endpoint: str, ca_cert: bytes | None) -> grpc.Channel:
    if ca_cert is None:
        return grpc.insecure_channel(endpoint)
    return grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(ca_cert))


def auth_enabled(endpoint: str, ca_cert: bytes | None = None) -> bool:
    """Whether etcd refuses an unauthenticated read (raises EtcdStartError if unreachable)."""
    with _channel(endpoint, ca_cert) as channel:
        return _auth_enabled(channel, endpoint)


def _auth_enabled(channel: grpc.Channel, endpoint: str) -> bool:
    try:
        etcdrpc.KVStub(channel).Range(etcdrpc.RangeRequest(key=b"\0", limit=1), timeout=_RPC_TIMEOUT_S)
    except grpc.RpcError as exc:
        if _refused(exc):
            return True
        raise EtcdStartError(f"etcd at {endpoint} did not answer: {exc.code().name}: {exc.details()}") from exc
    return False


def enable_root_auth(endpoint: str, password: str, ca_cert: bytes | None = None) -> bool:
    """Turn auth on with user ``root`` / ``password`` unless it is on; True if it turned it on."""
    if auth_enabled(endpoint, ca_cert):
        return False
    with _channel(endpoint, ca_cert) as channel:
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


def audit_auth(endpoint: str, password: str, ca_cert: bytes | None = None) -> None:
    """Check the auth set-up (module docstring); ``EtcdAuditError`` naming every deviation,
    EtcdStartError if etcd does not answer."""
    with _channel(endpoint, ca_cert) as channel:
        if not _auth_enabled(channel, endpoint):
            raise EtcdAuditError(f"auth is off on the embedded etcd at {endpoint}, although this daemon "
                                 f"turned it on: someone turned it off (with the root credential); "
                                 f"refusing to run on it")
        auth = etcdrpc.AuthStub(channel)
        try:
            try:
                token = auth.Authenticate(etcdrpc.AuthenticateRequest(name=ROOT_USER, password=password),
                                          timeout=_RPC_TIMEOUT_S).token
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                raise EtcdAuditError(f"the embedded etcd at {endpoint} refuses user {ROOT_USER!r} with the "
                                     f"password of {PASSWORD_FILE} ({exc.details()}): its root credential "
                                     f"was changed; refusing to run on it") from exc
            call = {"metadata": [("token", token)], "timeout": _RPC_TIMEOUT_S}
            users = list(auth.UserList(etcdrpc.AuthUserListRequest(), **call).users)
            roles = list(auth.RoleList(etcdrpc.AuthRoleListRequest(), **call).roles)
            user_roles = {u: list(auth.UserGet(etcdrpc.AuthUserGetRequest(name=u), **call).roles)
                          for u in users if u in EXPECTED_USERS}
            role_perms = {r: [_permission(p) for p in auth.RoleGet(etcdrpc.AuthRoleGetRequest(role=r), **call).perm]
                          for r in roles if r in EXPECTED_ROLES}
        except grpc.RpcError as exc:
            raise EtcdStartError(f"cannot audit the users and roles of the embedded etcd at {endpoint}: "
                                 f"{exc.code().name}: {exc.details()}") from exc
    problems = audit_problems(users, roles, user_roles, role_perms)
    if problems:
        raise EtcdAuditError(
            f"the embedded etcd at {endpoint} has users or roles this daemon did not make: "
            f"{'; '.join(problems)}. Refusing to start: someone may have got in. Look with "
            f"`etcdctl --user root:$(cat STATE_DIR/etcd/{PASSWORD_FILE}) user list / role list / "
            f"role get NAME` (on a --etcd-listen daemon, against it while it runs on loopback, or "
            f"with --cacert STATE_DIR/etcd/tls/ca.crt), then remove them (`user delete`, `role "
            f"delete`, `role revoke-permission`) or start from a fresh STATE_DIR/etcd")


def audit_problems(users: list[str], roles: list[str], user_roles: dict[str, list[str]],
                   role_perms: dict[str, list[str]]) -> list[str]:
    """What differs from ``EXPECTED_USERS`` / ``EXPECTED_ROLES`` (empty: nothing)."""
    out = []
    if extra := sorted(set(users) - set(EXPECTED_USERS)):
        out.append(f"unexpected user(s) {', '.join(extra)}")
    if missing := sorted(set(EXPECTED_USERS) - set(users)):
        out.append(f"missing user(s) {', '.join(missing)}")
    if extra := sorted(set(roles) - set(EXPECTED_ROLES)):
        out.append(f"unexpected role(s) {', '.join(extra)}")
    if missing := sorted(set(EXPECTED_ROLES) - set(roles)):
        out.append(f"missing role(s) {', '.join(missing)}")
    for user, wanted in EXPECTED_USERS.items():
        if user in user_roles and sorted(user_roles[user]) != sorted(wanted):
            out.append(f"user {user} has roles [{', '.join(user_roles[user])}], not [{', '.join(wanted)}]")
    for role, wanted in EXPECTED_ROLES.items():
        if role in role_perms and sorted(role_perms[role]) != sorted(wanted):
            out.append(f"role {role} carries permissions [{', '.join(role_perms[role])}], not "
                       f"[{', '.join(wanted)}]")
    return out


def _permission(perm) -> str:
    kind = {0: "read", 1: "write", 2: "readwrite"}.get(perm.permType, str(perm.permType))
    key = perm.key.decode("utf-8", "replace")
    end = perm.range_end.decode("utf-8", "replace") if perm.range_end else ""
    return f"{kind} {key!r}" + (f"..{end!r}" if end else "")


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
