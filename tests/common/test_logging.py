"""Logging setup: JSON lines with bound fields, stdlib routed through, mode choice."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog

from planaria.common import logging as plog


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    structlog.reset_defaults()


def lines_of(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_json_lines_carry_bound_fields(restore_root_logging):
    stream = io.StringIO()
    plog.configure(json=True, level="DEBUG", stream=stream, environ={})
    log = plog.get_logger("planaria.supervisor", engine_id=3, pid=4242, rank=1)
    log.info("engine started", port=5555)
    log.debug("step", num_running=2)
    records = lines_of(stream)
    assert len(records) == 2
    first = records[0]
    assert first["event"] == "engine started"
    assert (first["engine_id"], first["pid"], first["rank"], first["port"]) == (3, 4242, 1, 5555)
    assert first["level"] == "info"
    assert first["logger"] == "planaria.supervisor"
    assert "timestamp" in first
    assert records[1]["level"] == "debug" and records[1]["num_running"] == 2


def test_stdlib_logging_goes_through_the_same_renderer(restore_root_logging):
    stream = io.StringIO()
    plog.configure(json=True, level="INFO", stream=stream, environ={})
    logging.getLogger("some.library").warning("disk at %d%%", 91, extra={"engine_id": 0})
    logging.getLogger("some.library").debug("hidden below INFO")
    (record,) = lines_of(stream)
    assert record["event"] == "disk at 91%"
    assert record["level"] == "warning"
    assert record["logger"] == "some.library"
    assert record["engine_id"] == 0


def test_exceptions_are_structured(restore_root_logging):
    stream = io.StringIO()
    plog.configure(json=True, stream=stream, environ={})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        plog.get_logger(engine_id=1).exception("step failed")
    (record,) = lines_of(stream)
    assert record["exception"][0]["exc_type"] == "RuntimeError"
    assert record["exception"][0]["exc_value"] == "boom"


def test_console_mode_is_not_json(restore_root_logging):
    stream = io.StringIO()
    plog.configure(json=False, stream=stream, environ={})
    plog.get_logger(engine_id=7).info("hello")
    out = stream.getvalue()
    assert "hello" in out and "engine_id" in out and "7" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.splitlines()[0])


def test_configure_twice_keeps_one_handler(restore_root_logging):
    before = len(logging.getLogger().handlers)
    plog.configure(json=True, stream=io.StringIO(), environ={})
    plog.configure(json=True, stream=io.StringIO(), environ={})
    assert len(logging.getLogger().handlers) == before + 1


def test_unknown_level_raises(restore_root_logging):
    with pytest.raises(ValueError):
        plog.configure(level="LOUD", stream=io.StringIO(), environ={})


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream,env,expected", [
    (io.StringIO(), {}, True),
    (_Tty(), {}, False),
    (_Tty(), {"JOURNAL_STREAM": "8:12345"}, True),
    (_Tty(), {"INVOCATION_ID": "abc"}, True),
    (_Tty(), {"PLANARIA_LOG_FORMAT": "json"}, True),
    (io.StringIO(), {"PLANARIA_LOG_FORMAT": "console"}, False),
    (io.StringIO(), {"PLANARIA_LOG_FORMAT": "nonsense"}, True),
])
def test_wants_json(stream, env, expected):
    assert plog.wants_json(stream, env) is expected


def test_process_fields_are_on_every_line_from_any_thread(restore_root_logging):
    import threading

    stream = io.StringIO()
    try:
        plog.bind_process(engine_id=4, pid=999)
        plog.configure(json=True, stream=stream, environ={})
        logging.getLogger("planaria.engine.proc").info("engine %d ready", 4)
        t = threading.Thread(target=lambda: logging.getLogger("planaria.engine.proc_io").warning("io"))
        t.start()
        t.join()
        plog.get_logger("planaria.x").info("bound here", pid=1)  # the call's own field wins
        plog.bind_process(rank=2)
        plog.get_logger().info("joined")
        plog.bind_process(rank=None)
        plog.get_logger().info("left")
    finally:
        plog._process_fields.clear()
    ready, io_line, bound, joined, left = lines_of(stream)
    assert (ready["event"], ready["engine_id"], ready["pid"]) == ("engine 4 ready", 4, 999)
    assert (io_line["engine_id"], io_line["pid"]) == (4, 999)
    assert bound["pid"] == 1 and bound["engine_id"] == 4
    assert joined["rank"] == 2 and "rank" not in left


def test_configure_child_binds_the_real_pid(restore_root_logging, monkeypatch, capsys):
    import os

    monkeypatch.setenv("PLANARIA_LOG_FORMAT", "json")
    try:
        plog.configure_child("INFO", engine_id=0)
        logging.getLogger("frontend").info("hello")
    finally:
        plog._process_fields.clear()
    (record,) = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert (record["engine_id"], record["pid"], record["event"]) == (0, os.getpid(), "hello")
