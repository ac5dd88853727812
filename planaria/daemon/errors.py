"""Errors of the daemon package.

The admin protocol's errors (``AdminError`` and its subclass per code, ``NotRunningError``,
``AuthRefusedError``, ``MalformedReplyError``) and the one place exceptions become codes
(``to_reply``) live in ``planaria.common.errors``, shared with the frontend. Here are the
daemon's own. Keep causes: ``raise ... from exc``.
"""

from __future__ import annotations


class DaemonError(Exception):
    """Base class for every error of the daemon package."""


class DaemonAlreadyRunningError(DaemonError):
    """Another supervisor holds this runtime directory's control socket."""


class AdminKeyError(DaemonError):
    """A CurveZMQ key file is missing, unreadable or not a key (daemon/admin_keys.py)."""


class RuntimeDirError(DaemonError):
    """The runtime directory is unsafe for the daemon's sockets: writable by others, or
    owned by another user (who could then bind sockets there, e.g. pose as an engine and
    receive prompts)."""
