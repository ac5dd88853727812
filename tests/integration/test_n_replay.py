"""n > 1 across an engine death: `planaria serve` with one engine of the real
SmolLM2-135M-Instruct; a streamed request with n = 3 seeded choices; the engine is
SIGKILLed mid-stream; the supervisor restarts it and the frontend's journal replays each
choice on its own (prompt + the tokens already sent, seeded sampling counting them as
output). Every choice's reassembled text equals the fault-free run's."""

from __future__ import annotations

import json
import os
import re
import signal

import openai
import pytest

from tests.integration.test_supervisor import Daemon, _stop_tree

pytestmark = pytest.mark.timeout(600)

ENGINE_CONFIG = {"kv_cache_bytes": 64 * 2**20, "max_model_len": 1024, "max_num_seqs": 8,
                 "max_num_batched_tokens": 1024, "num_threads": 1, "dtype": "float32"}


@pytest.mark.slow
def test_n_choices_stream_on_across_an_engine_death(real_models, tmp_path):
    d = Daemon(real_models("smollm2"), tmp_path, extra_args=(
        "--engines", "1", "--engine-config-json", json.dumps(ENGINE_CONFIG), "--hang-timeout-s", "30"))
    try:
        victim = d.wait_all_up(1, 300)["engines"][0]["pid"]
        client = openai.OpenAI(base_url=f"{d.base}/v1", api_key="none", max_retries=0, timeout=300)
        kw = dict(model=client.models.list().data[0].id, n=3, seed=1234, temperature=0.8, max_tokens=48,
                  messages=[{"role": "user", "content": "Tell me a short story about a lighthouse."}])
        reference = client.chat.completions.create(**kw)
        expected = {c.index: c.message.content for c in reference.choices}
        assert len(set(expected.values())) == 3, expected
        parts: dict[int, str] = {}
        num_chunks = 0
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                parts[ch.index] = parts.get(ch.index, "") + (ch.delta.content or "")
                num_chunks += 1
                if num_chunks == 20:
                    os.kill(victim, signal.SIGKILL)
        assert parts == expected
        _, metrics = d.http("/metrics")
        assert re.search(r"^planaria_request_replays_total [1-9]", metrics, re.M), "no replay happened"
    finally:
        _stop_tree(d.proc)
