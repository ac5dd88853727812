"""How to reach a secured etcd: TLS files and a user with a password file.

``EtcdSecurity`` is what ``planaria serve --etcd-ca-cert/--etcd-cert/--etcd-key/
--etcd-user/--etcd-password-file`` gives; the supervisor passes it to its engine processes
through the environment (``to_env`` / ``from_env``: file paths and the user name, never the
password itself, and never on a command line, which any local user can read in ``ps``).
No grpc import here, so the daemon's configuration can validate it cheaply.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import msgspec

ENV = {"ca_cert": "PLANARIA_ETCD_CA_CERT", "cert": "PLANARIA_ETCD_CERT", "key": "PLANARIA_ETCD_KEY",
       "user": "PLANARIA_ETCD_USER", "password_file": "PLANARIA_ETCD_PASSWORD_FILE"}


class EtcdSecurity(msgspec.Struct, frozen=True, kw_only=True):
    ca_cert: str = ""        # PEM of the CA that signed etcd's server certificate
    cert: str = ""           # client certificate (etcd --client-cert-auth), with key
    key: str = ""
    user: str = ""           # etcd user (auth enabled), with password_file
    password_file: str = ""  # holds the password (one line; a trailing newline is dropped)

    @property
    def tls(self) -> bool:
        return bool(self.ca_cert or self.cert)

    @property
    def auth(self) -> bool:
        return bool(self.user)

    def problems(self) -> list[str]:
        """What is wrong with these settings (empty when usable)."""
        out = []
        if bool(self.cert) != bool(self.key):
            out.append("--etcd-cert and --etcd-key go together")
        if bool(self.user) != bool(self.password_file):
            out.append("--etcd-user and --etcd-password-file go together")
        for flag, path in (("--etcd-ca-cert", self.ca_cert), ("--etcd-cert", self.cert),
                           ("--etcd-key", self.key), ("--etcd-password-file", self.password_file)):
            if path and not os.access(path, os.R_OK):
                out.append(f"{flag} {path}: not a readable file")
        return out

    def validate(self) -> "EtcdSecurity":
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def password(self) -> str:
        text = Path(self.password_file).read_text()
        return text[:-1] if text.endswith("\n") else text

    def read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        return Path(path).read_bytes() if path else None

    def to_env(self) -> dict[str, str]:
        return {ENV[f]: getattr(self, f) for f in ENV if getattr(self, f)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "EtcdSecurity":
        env = os.environ if environ is None else environ
        return cls(**{f: env.get(name, "") for f, name in ENV.items()})
