"""A tool call streams on across an engine death: `planaria serve` with one engine of the
real SmolLM2-135M-Instruct; the engine is SIGKILLed while a named tool call's arguments
stream; the supervisor restarts it and the frontend's journal replays the request onto
it (prompt + the tokens already sent, which the grammar takes as its prefix). The
client's reassembled call is the fault-free one and its arguments validate."""

from __future__ import annotations

import json
import os
import re
import signal

import openai
import pytest

from tests.engine.test_structured_output import validate
from tests.integration.test_supervisor import Daemon, _stop_tree

pytest.importorskip("llguidance")
pytestmark = pytest.mark.timeout(600)

ENGINE_CONFIG = {"kv_cache_bytes": 64 * 2**20, "max_model_len": 1024, "max_num_seqs": 8,
                 "max_num_batched_tokens": 1024, "num_threads": 1, "dtype": "float32"}
REPORT = {"type": "function", "function": {
    "name": "file_report", "description": "File a weather report for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "report": {"type": "string", "minLength": 120, "maxLength": 200}},
        "required": ["city", "report"], "additionalProperties": False}}}


@pytest.mark.slow
def test_named_tool_call_streams_on_across_an_engine_death(real_models, tmp_path):
    d = Daemon(real_models("smollm2"), tmp_path, extra_args=(
        "--engines", "1", "--engine-config-json", json.dumps(ENGINE_CONFIG), "--hang-timeout-s", "30"))
    try:
        victim = d.wait_all_up(1, 300)["engines"][0]["pid"]
        client = openai.OpenAI(base_url=f"{d.base}/v1", api_key="none", max_retries=0, timeout=300)
        kw = dict(model=client.models.list().data[0].id, tools=[REPORT], temperature=0.0, max_tokens=200,
                  messages=[{"role": "user", "content": "Write a weather report for Paris."}],
                  tool_choice={"type": "function", "function": {"name": "file_report"}})
        reference = client.chat.completions.create(**kw).choices[0]
        assert reference.finish_reason == "tool_calls", reference
        expected = reference.message.tool_calls[0].function.arguments
        arguments, num_deltas, finish = "", 0, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                for tc in ch.delta.tool_calls or []:
                    arguments += tc.function.arguments or ""
                    num_deltas += 1
                    if num_deltas == 4:
                        os.kill(victim, signal.SIGKILL)
                finish = ch.finish_reason or finish
        assert (arguments, finish) == (expected, "tool_calls")
        validate(json.loads(arguments), REPORT["function"]["parameters"])
        _, metrics = d.http("/metrics")
        assert re.search(r"^planaria_request_replays_total [1-9]", metrics, re.M), "no replay happened"
        status = d.wait(lambda s: s["engines"][0]["restarts"] >= 1 and s["num_up"] == 1, 120, "the engine back")
        assert status["engines"][0]["pid"] != victim
    finally:
        _stop_tree(d.proc)
