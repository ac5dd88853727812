"""The embedded etcd's secured start: auth on, and audited, before it listens beyond loopback.

etcd can only turn auth on once it serves, so a first start on an outside address (`serve
--etcd-listen 10.0.0.1`) would give a peer the moment between the listen and the auth
set-up to add a root user of its own or lock the daemon out. So an *exposed* etcd (one whose
listen address is not loopback: ``is_loopback``) goes through a private phase first::

    exposed, the first start of this daemon (``bootstrap=True``):
        1. the same member on 127.0.0.1, a port of its own, plain   (EmbeddedEtcd.on_loopback)
        2. auth on with the root credential if it is off            (etcd_auth.enable_root_auth)
        3. audit: the users and roles are the daemon's own          (etcd_auth.audit_auth)
        4. stop it; start the member on its outside address, TLS only (auth is on in its data)
        5. auth on? audit again, over TLS
    exposed, a restart (the keeper's, after a crash): 4 and 5; auth found off there means a
        bootstrap again next time (the keeper asks for one after a failed start)
    loopback (the default, ``make serve``): start, 2 and 3; no TLS

Any failure stops etcd (nothing keeps listening) and raises: ``EtcdAuditError`` for users,
roles or permissions the daemon did not make (it refuses to run on such a data dir rather
than removing them: see etcd_auth.py), ``EtcdStartError`` otherwise.

``embedded_etcd(etcd_dir, host, port)`` builds the pieces ``serve`` needs: the root
credential (etcd_auth.py), and for an exposed etcd its TLS files (etcd_pki.py: a CA of the
daemon's own) with the daemon's client set to trust that CA. ``exposed`` is decided from
``host`` unless given: tests pass ``exposed=True`` with a loopback alias (127.0.0.2) to run
the code path of an outside address on one machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from planaria.elastic.etcd_auth import audit_auth, enable_root_auth, root_credential
from planaria.elastic.etcd_pki import TLS_DIR, server_tls, tls_hosts
from planaria.elastic.etcd_security import EtcdSecurity
from planaria.elastic.etcd_server import EmbeddedEtcd, is_loopback

log = structlog.get_logger(__name__)

MEMBER_NAME = "planaria"  # fixed: the data dir remembers it across daemon restarts


@dataclass(frozen=True)
class Embedded:
    """What ``serve`` runs: the etcd, the credential its clients use, and whether it is exposed."""

    etcd: EmbeddedEtcd
    security: EtcdSecurity
    exposed: bool


def embedded_etcd(etcd_dir: str | os.PathLike[str], host: str = "127.0.0.1", port: int | None = None, *,
                  advertise_host: str = "", exposed: bool | None = None,
                  die_with_parent: bool = True) -> Embedded:
    """The embedded etcd under ``etcd_dir`` listening on ``host``:``port`` (not started)."""
    exposed = not is_loopback(host) if exposed is None else exposed
    security = root_credential(etcd_dir)
    tls = None
    if exposed:
        tls = server_tls(Path(etcd_dir) / TLS_DIR, tls_hosts(host, advertise_host))
        security = msgspec.structs.replace(security, ca_cert=tls.ca)
    etcd = EmbeddedEtcd(etcd_dir, client_port=port, host=host, name=MEMBER_NAME, tls=tls,
                        die_with_parent=die_with_parent)
    return Embedded(etcd, security, exposed)


def start_secured(etcd: EmbeddedEtcd, password: str, *, exposed: bool, bootstrap: bool = True,
                  timeout_s: float = 20.0) -> bool:
    """Start ``etcd`` as the module docstring says; True if auth was turned on by this call
    (a fresh data dir). On any failure etcd is stopped and the error raised."""
    turned_on = False
    if exposed and bootstrap:
        private = etcd.on_loopback()
        private.start(timeout_s)
        try:
            turned_on = enable_root_auth(private.endpoint, password)
            audit_auth(private.endpoint, password)
        finally:
            private.stop()
        log.info("etcd_auth_ready_on_loopback", endpoint=private.endpoint, auth_turned_on=turned_on)
    ca = Path(etcd.tls.ca).read_bytes() if etcd.tls is not None else None
    etcd.start(timeout_s)
    try:
        if not exposed:
            turned_on = enable_root_auth(etcd.endpoint, password)
        audit_auth(etcd.endpoint, password, ca)
    except BaseException:
        etcd.stop()
        raise
    return turned_on
