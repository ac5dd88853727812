"""One request never kills an engine (issue 11): a real engine process, a hand-written
frontend (RawFrontend). A request whose preparation raises gets its own error output with a
code, a full waiting queue answers "overloaded" at once, and the engine serves on, same pid."""

from pathlib import Path

import pytest

from planaria.engine.messages import OutputErrorCode
from planaria.engine.structured_output import MAX_SCHEMA_DEPTH
from planaria.engine.wire import MsgType, UtilityCall
from tests.engine._engine_procs import RawFrontend, engine_config, engine_log, request, spawn_engine, stop_engine

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="session")
def tiny_model(tiny_moe):
    return Path(tiny_moe)


def _engine(tmp: Path, model: Path, **config):
    fe = RawFrontend(tmp)
    proc = spawn_engine(0, fe.input_addr, tmp, config=None)
    try:
        fe.handshake(0, settings={"engine_config": engine_config(model, **config)})
    except BaseException:
        stop_engine(proc)
        fe.close()
        raise
    return fe, proc


def _pid(fe) -> int:
    fe.send(0, MsgType.UTILITY, UtilityCall(call_id=7, method="ping"))
    while True:
        t, msg = fe.recv_pull()
        if t == MsgType.UTILITY_RESULT and msg.call_id == 7:
            assert msg.ok, msg.error
            return msg.result["pid"]


def _nested_schema(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_poison_requests_fail_alone_and_the_engine_serves_on(tiny_model, tmp_path_factory):
    fe, proc = _engine(tmp_path_factory.mktemp("poison"), tiny_model)
    try:
        poison = {
            # the reproducer: json.loads of it raises RecursionError inside add_request
            "deep-text": {"type": "json_schema", "value": "[" * 200_000},
            # a schema (a dict on the wire) deeper than llguidance can take without crashing
            "deep-dict": {"type": "json_schema", "value": _nested_schema(MAX_SCHEMA_DEPTH)},
            "bad-spec": {"type": "no-such-type"},
        }
        for rid, spec in poison.items():
            req = request(rid, max_tokens=4)
            req.structured_output = spec
            fe.send(0, MsgType.ADD, req)
        fe.send(0, MsgType.ADD, request("after", max_tokens=6))
        got = fe.collect(set(poison) | {"after"}, timeout_s=90)
        for rid in poison:
            last = got[rid][-1]
            assert last.finish_reason == "error" and last.new_token_ids == [], (rid, last)
            assert last.error_code == OutputErrorCode.INVALID_REQUEST.value, (rid, last)
        assert "nested too deeply" in got["deep-text"][-1].error
        assert f"nested deeper than {MAX_SCHEMA_DEPTH} levels" in got["deep-dict"][-1].error
        assert "structured_output must be a dict" in got["bad-spec"][-1].error
        after = got["after"]
        assert after[-1].finish_reason == "length" and after[-1].error_code is None
        assert len([t for o in after for t in o.new_token_ids]) == 6
        assert proc.poll() is None, engine_log(proc)
        assert _pid(fe) == proc.pid  # the same process served it all
    finally:
        stop_engine(proc)
        fe.close()


def test_a_full_waiting_queue_answers_overloaded_at_once(tiny_model, tmp_path_factory):
    fe, proc = _engine(tmp_path_factory.mktemp("overload"), tiny_model, max_num_seqs=2, max_num_waiting=2)
    try:
        ids = [f"r{i}" for i in range(20)]
        for rid in ids:  # at most 2 run and 2 wait: a request takes 64 steps, the burst far less
            fe.send(0, MsgType.ADD, request(rid, max_tokens=64))
        got = fe.collect(set(ids), timeout_s=180)
        overloaded = [rid for rid in ids if got[rid][-1].finish_reason == "error"]
        served = [rid for rid in ids if rid not in overloaded]
        assert overloaded and len(served) >= 2, (overloaded, served)
        for rid in overloaded:
            last = got[rid][-1]
            assert last.error_code == OutputErrorCode.OVERLOADED.value and last.new_token_ids == []
            assert "overloaded" in last.error and "max_num_waiting=2" in last.error, last.error
        for rid in served:
            assert got[rid][-1].finish_reason == "length"
            assert len([t for o in got[rid] for t in o.new_token_ids]) == 64
        fe.send(0, MsgType.ADD, request("later", max_tokens=3))  # the queue drained: taken again
        assert fe.collect({"later"})["later"][-1].finish_reason == "length"
        assert proc.poll() is None and _pid(fe) == proc.pid
    finally:
        stop_engine(proc)
        fe.close()
