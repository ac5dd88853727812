"""A throwaway PKI for TLS tests, made with the openssl command line: a CA, a server
certificate for 127.0.0.1 / localhost, a client certificate, and an unrelated CA."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import msgspec


class PKI(msgspec.Struct, frozen=True):
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str  # a CA that signed none of these


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(root: Path) -> PKI | None:
    """Certificates under ``root``; None when openssl is not installed."""
    if shutil.which("openssl") is None:
        return None
    root.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
                 "-days", "2", "-subj", f"/CN=planaria-test-{ca}", cwd=root)
    for name, cn, ext in (("server", "127.0.0.1", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                                  "extendedKeyUsage=serverAuth,clientAuth\n"),
                          ("client", "planaria-client", "extendedKeyUsage=clientAuth\n")):
        (root / f"{name}.ext").write_text(ext)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={cn}", cwd=root)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=root)
    for key in root.glob("*.key"):
        key.chmod(0o600)
    p = {n: str(root / n) for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key",
                                    "other-ca.crt")}
    return PKI(ca=p["ca.crt"], server_cert=p["server.crt"], server_key=p["server.key"],
                   client_cert=p["client.crt"], client_key=p["client.key"], other_ca=p["other-ca.crt"])


def secure_etcd(root: Path, pki: PKI, user: str, password: str, token_ttl_s: int | None = None):
    """A started EmbeddedEtcd with TLS (client certificates required) and auth on: ``user``
    may read and write /planaria/ only. Returns (etcd, password file)."""
    from planaria.elastic.etcd_server import EmbeddedEtcd, ServerTLS

    extra = ["--auth-token-ttl", str(token_ttl_s)] if token_ttl_s else []
    etcd = EmbeddedEtcd(root / "etcd", tls=ServerTLS(cert=pki.server_cert, key=pki.server_key, ca=pki.ca),
                        extra_args=extra).start()
    etcd.ctl("user", "add", "root", "--new-user-password=root-not-used-by-planaria")
    etcd.ctl("role", "add", "planaria")
    etcd.ctl("role", "grant-permission", "planaria", "--prefix=true", "readwrite", "/planaria/")
    etcd.ctl("user", "add", user, f"--new-user-password={password}")
    etcd.ctl("user", "grant-role", user, "planaria")
    etcd.ctl("auth", "enable")
    password_file = root / "etcd-password"
    password_file.write_text(password + "\n")
    password_file.chmod(0o600)
    return etcd, str(password_file)
