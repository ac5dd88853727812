"""Logging setup: structlog in front, stdlib logging routed through the same renderer.

``configure()`` once at process start (the supervisor, and each child it spawns); then
``get_logger(engine_id=3, rank=1)`` anywhere. A child process calls
``configure_child(level, engine_id=3)`` instead: its pid and the given fields go on every
line it writes, from any thread and from stdlib loggers too; ``bind_process(rank=2)``
adds or changes such a field later (an EP rank that joins a new epoch). Lines are JSON (one object per line) when
the stream is not a terminal or when systemd runs us (``$JOURNAL_STREAM`` or
``$INVOCATION_ID`` set), and a readable console rendering on a terminal.
``$PLANARIA_LOG_FORMAT=json|console`` overrides the choice, ``$PLANARIA_LOG_LEVEL`` the
level. Records from stdlib loggers (``logging.getLogger(__name__)``, libraries) go
through the same processors, so the output has one format.

Note: this module is ``planaria.common.logging``; it imports the standard library's
``logging`` by absolute import. Do not run files inside ``common/`` as scripts (``python
common/x.py``), which would put this file first on ``sys.path`` as ``logging``; use
``python -m planaria.common.x``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import IO, Any

import structlog

_HANDLER_NAME = "planaria"


def wants_json(stream: IO[str] | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """JSON unless the stream is an interactive terminal outside systemd."""
    env = os.environ if environ is None else environ
    forced = env.get("PLANARIA_LOG_FORMAT", "").strip().lower()
    if forced in ("json", "console"):
        return forced == "json"
    if env.get("JOURNAL_STREAM") or env.get("INVOCATION_ID"):
        return True
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return not (isatty is not None and isatty())


_process_fields: dict[str, Any] = {}  # bound to every line of this process


def bind_process(**fields: Any) -> None:
    """Bind ``fields`` to every later line of this process (None removes a field)."""
    for key, value in fields.items():
        if value is None:
            _process_fields.pop(key, None)
        else:
            _process_fields[key] = value


def _add_process_fields(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    for key, value in _process_fields.items():
        event_dict.setdefault(key, value)  # a field given on the call itself wins
    return event_dict


def _shared_processors() -> list[Any]:
    return [
        _add_process_fields,
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def configure(*, json: bool | None = None, level: int | str | None = None,
              stream: IO[str] | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Set up structlog and the stdlib root logger; calling it again replaces the setup.

    ``json`` None decides by ``wants_json(stream, environ)``; ``level`` None reads
    ``$PLANARIA_LOG_LEVEL`` (default INFO); ``stream`` defaults to stderr.
    """
    env = os.environ if environ is None else environ
    stream = sys.stderr if stream is None else stream
    use_json = wants_json(stream, env) if json is None else json
    if level is None:
        level = env.get("PLANARIA_LOG_LEVEL", "INFO").upper()
    if isinstance(level, str):
        resolved = logging.getLevelName(level)
        if not isinstance(resolved, int):
            raise ValueError(f"unknown log level {level!r}")
        level = resolved

    if use_json:
        renderer: list[Any] = [structlog.processors.dict_tracebacks,
                               structlog.processors.JSONRenderer(sort_keys=False)]
    else:
        isatty = getattr(stream, "isatty", None)
        renderer = [structlog.dev.ConsoleRenderer(colors=bool(isatty and isatty()))]

    shared = _shared_processors()
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.stdlib.PositionalArgumentsFormatter(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached, so that a later configure() (tests, a child after fork) applies
        # to loggers made before it.
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)

    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)


def configure_child(level: int | str | None = None, **fields: Any) -> None:
    """Logging for a child process of the supervisor (engine core, frontend): the same
    format choice as ``configure`` (JSON under systemd, when asked, or when the output is
    not a terminal, as in the supervisor's log files), with ``pid`` and ``fields`` (e.g.
    ``engine_id``) on every line."""
    _process_fields.clear()
    bind_process(pid=os.getpid(), **fields)
    configure(level=level)


def should_log(count: int) -> bool:
    """For a warning per bad message (the ``count``-th so far): the first 20, then every
    1000th, so that a flood of them cannot fill the log."""
    return count <= 20 or count % 1000 == 0


def get_logger(name: str | None = None, **bind: Any) -> structlog.stdlib.BoundLogger:
    """A logger whose every line carries ``bind`` (e.g. engine_id=, pid=, rank=)."""
    logger = structlog.stdlib.get_logger(name or "planaria")
    return logger.bind(**bind) if bind else logger
