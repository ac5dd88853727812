"""TLS files for the embedded etcd when it listens beyond loopback (`serve --etcd-listen`).

``server_tls(tls_dir, hosts)`` returns the ``ServerTLS`` etcd serves clients with, made
with the ``openssl`` command line (the ``cryptography`` package is not a dependency) on
first use and kept across restarts::

    STATE_DIR/etcd/tls/   (0700)
        ca.crt  ca.key      a CA of this daemon's own (EC P-256, 10 years); ca.key 0600
        server.crt          etcd's certificate, signed by that CA, for ``hosts`` (IP SANs,
        server.key          and DNS:localhost), 825 days, renewed 30 days before it ends; 0600
        server.hosts        the hosts server.crt was made for (one a line)

The other nodes (and ``etcdctl --cacert``) trust ``ca.crt``: copy it to them with the root
password file. Own PKI instead: put ``ca.crt``, ``server.crt`` and ``server.key`` there and
no ``ca.key``; they are then used as they are (never renewed, never checked for ``hosts``).
A server certificate made for other hosts (``--etcd-listen`` or ``--advertise-host``
changed) is made again with the same CA, so the other nodes' copies of ``ca.crt`` stay good.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterable
from pathlib import Path

import psutil

from planaria.elastic.errors import EtcdStartError
from planaria.elastic.etcd_server import ServerTLS

TLS_DIR = "tls"
CA_DAYS = 3650
SERVER_DAYS = 825
RENEW_BEFORE_S = 30 * 24 * 3600
_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def tls_hosts(listen_host: str, advertise_host: str = "") -> list[str]:
    """The IPs etcd's certificate must name: the listen address (every address of this
    host for 0.0.0.0 / ::), the advertised one, and loopback (the daemon's own client)."""
    hosts = ["127.0.0.1", "::1"]
    unspecified = ipaddress.ip_address(listen_host).is_unspecified
    if unspecified:
        hosts += _interface_addresses()
    else:
        hosts.append(listen_host)
    if advertise_host:
        hosts.append(advertise_host)
    return list(dict.fromkeys(str(ipaddress.ip_address(h)) for h in hosts))


def _interface_addresses() -> list[str]:
    out = []
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                host = a.address.split("%")[0]  # fe80::1%eth0: the zone is not part of a SAN
                try:
                    ipaddress.ip_address(host)
                except ValueError:
                    continue
                out.append(host)
    return out


def server_tls(tls_dir: str | os.PathLike[str], hosts: Iterable[str]) -> ServerTLS:
    """etcd's server TLS under ``tls_dir`` for ``hosts``, made or renewed as the module
    docstring says; EtcdStartError when openssl is missing or fails."""
    directory = Path(tls_dir)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    cert, key, made_for = directory / "server.crt", directory / "server.key", directory / "server.hosts"
    wanted = list(dict.fromkeys(hosts))
    tls = ServerTLS(cert=str(cert), key=str(key), ca=str(ca), client_cert_auth=False)
    if ca.exists() and cert.exists() and key.exists() and not ca_key.exists():
        return tls  # the operator's own PKI
    if not (ca.exists() and ca_key.exists()):
        _openssl("req", "-x509", "-new", *_EC, "-keyout", "ca.key", "-out", "ca.crt", "-days", str(CA_DAYS),
                 "-subj", "/CN=planaria-etcd-ca", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)
        cert.unlink(missing_ok=True)  # signed by a CA that is gone
    had = made_for.read_text().split() if made_for.exists() else []
    if not (cert.exists() and key.exists() and set(wanted) <= set(had) and _valid_for(cert, RENEW_BEFORE_S)):
        _make_server_cert(directory, wanted)
    for private in (ca_key, key):
        os.chmod(private, 0o600)
    return tls


def _make_server_cert(directory: Path, hosts: list[str]) -> None:
    sans = ",".join([*(f"IP:{h}" for h in hosts), "DNS:localhost"])
    (directory / "server.ext").write_text(
        f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nbasicConstraints=critical,CA:FALSE\n")
    _openssl("req", "-new", *_EC, "-keyout", "server.key.new", "-out", "server.csr",
             "-subj", "/CN=planaria-etcd", cwd=directory)
    os.chmod(directory / "server.key.new", 0o600)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-set_serial", f"0x{secrets.randbits(120):030x}", "-days", str(SERVER_DAYS),
             "-extfile", "server.ext", "-out", "server.crt.new", cwd=directory)
    os.replace(directory / "server.key.new", directory / "server.key")
    os.replace(directory / "server.crt.new", directory / "server.crt")
    (directory / "server.hosts").write_text("".join(f"{h}\n" for h in hosts))
    (directory / "server.csr").unlink(missing_ok=True)


def _valid_for(cert: Path, seconds: int) -> bool:
    proc = subprocess.run(["openssl", "x509", "-checkend", str(seconds), "-noout", "-in", str(cert)],
                          capture_output=True, timeout=30)
    return proc.returncode == 0


def _openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise EtcdStartError("etcd beyond loopback is served over TLS, and making its certificate "
                             "needs the openssl command (apt-get install openssl), or put your own "
                             f"ca.crt, server.crt and server.key in {cwd}")
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise EtcdStartError(f"openssl {args[0]} failed in {cwd}: {proc.stderr.strip()[-500:]}")
