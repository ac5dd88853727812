"""What the entry points of an engine process (``planaria.engine.proc``,
``planaria.elastic.ep_proc``) share: JSON arguments and the child's logging."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from planaria.common.logging import configure_child


def json_arg(text: str | None) -> Any:
    """A JSON command-line value, or ``@path`` of a file holding one (None stays None)."""
    if text is None:
        return None
    if text.startswith("@"):
        with open(text[1:], "rb") as f:
            text = f.read()
    return msgspec.json.decode(text)


def setup_logging(engine_index: int, level: str) -> None:
    """The daemon's format (JSON lines in its log files), ``engine_id`` on every line."""
    configure_child(getattr(logging, level.upper(), logging.INFO), engine_id=engine_index)
