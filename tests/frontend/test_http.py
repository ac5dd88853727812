"""The frontend for real: a tiny-moe demo model, two engine-core processes and the
frontend process on a free loopback port, driven by the official openai client."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import aiohttp
import openai
import pytest

from tests.frontend._stack import openai_client, run_async, serving

pytest.importorskip("planaria.engine.detokenizer", reason="engine/detokenizer.py is not there yet")

NUM_ENGINES = 2
MAX_MODEL_LEN = 256
ENGINE_CONFIG = dict(kv_cache_bytes=16 * 2**20, max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                     max_num_batched_tokens=1024, num_threads=1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from planaria.engine.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("frontend-http")
    with serving(root, build_demo_model(root / "tiny-moe", "tiny-moe"), NUM_ENGINES, ENGINE_CONFIG) as s:
        yield s


def run(coro, timeout_s: float = 60.0):
    return run_async(coro, timeout_s)


def oai(stack) -> openai.AsyncOpenAI:
    return openai_client(stack, 60)


async def _get(stack, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s:
        async with s.get(stack.base + path) as r:
            return r.status, await r.text()


def test_models_health_ready(stack):
    async def main():
        async with oai(stack) as c:
            models = await c.models.list()
        assert [m.id for m in models.data] == ["tiny-moe"]
        assert (await _get(stack, "/health"))[0] == 200
        status, body = await _get(stack, "/ready")
        assert status == 200 and '"ready": true' in body
    run(main())


def test_concurrent_streams_finish_with_exact_token_counts(stack):
    num_each, max_tokens = 32, 12
    extra = {"ignore_eos": True}

    async def completion(c, i):
        stream = await c.completions.create(model="tiny-moe", prompt=f"def f{i}(x):", max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body=extra)
        text, finish, usage = "", None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
        return text, finish, usage

    async def chat(c, i):
        stream = await c.chat.completions.create(
            model="tiny-moe", messages=[{"role": "user", "content": f"say {i}"}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=extra)
        text, finish, usage = "", None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                text += ch.delta.content or ""
                finish = ch.finish_reason or finish
        return text, finish, usage

    async def main():
        async with oai(stack) as c:
            results = await asyncio.gather(*[completion(c, i) for i in range(num_each)],
                                           *[chat(c, i) for i in range(num_each)])
            for text, finish, usage in results:
                assert finish == "length" and usage.completion_tokens == max_tokens and text
            # greedy: the same prompt gives the same text streamed or not
            again = await c.completions.create(model="tiny-moe", prompt="def f3(x):", max_tokens=max_tokens,
                                               temperature=0, extra_body=extra)
            assert again.choices[0].text == results[3][0]
    run(main(), 120)


def test_non_streaming_completion_and_chat(stack):
    async def main():
        async with oai(stack) as c:
            r = await c.completions.create(model="tiny-moe", prompt="import os\n", max_tokens=5, logprobs=2,
                                           temperature=0, extra_body={"ignore_eos": True})
            ch = r.choices[0]
            assert r.id.startswith("cmpl-") and ch.finish_reason == "length" and r.usage.completion_tokens == 5
            assert len(ch.logprobs.tokens) == 5 and len(ch.logprobs.top_logprobs[0]) >= 1
            assert "".join(ch.logprobs.tokens) == ch.text and ch.logprobs.text_offset[0] == 0
            chat = await c.chat.completions.create(model="tiny-moe", max_completion_tokens=6,
                                                   messages=[{"role": "system", "content": "hi"},
                                                             {"role": "user", "content": "hello"}],
                                                   logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
            assert chat.id.startswith("chatcmpl-") and chat.usage.completion_tokens == 6
            assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
            assert len(chat.choices[0].logprobs.content) == 6
            assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
            # the chat template (ChatML) is applied: prompt tokens include its markers
            assert chat.usage.prompt_tokens > 6
    run(main())


def test_bad_bodies_are_400_with_reasons(stack):
    async def main():
        async with oai(stack) as c:
            cases = [
                (dict(prompt="x", max_tokens=0), "max_tokens"),
                (dict(prompt="", max_tokens=3), "prompt"),
                (dict(prompt="x", temperature=-1), "temperature"),
                (dict(prompt="x", logit_bias={"3": 1, "10000000": 1}), "logit_bias"),
                (dict(prompt=list(range(1, MAX_MODEL_LEN + 5))), "maximum context length"),
                (dict(prompt=[1, 10**6]), "vocabulary"),
            ]
            for kw, reason in cases:
                with pytest.raises(openai.BadRequestError) as ei:
                    await c.completions.create(model="tiny-moe", **kw)
                assert reason in str(ei.value), (kw, str(ei.value))
                assert ei.value.body["type"] == "invalid_request_error"
            with pytest.raises(openai.BadRequestError, match="tools"):
                await c.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "x"}],
                                                tools=[{"type": "function", "function": {"name": "f g"}}])
            # max_tokens beyond the context is capped, not refused
            r = await c.completions.create(model="tiny-moe", prompt=list(range(1, MAX_MODEL_LEN - 3)),
                                           max_tokens=100, extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    run(main())


def _gauge_sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}{{engine=\"\d+\"}} (\S+)$", text, re.M))


def test_abort_mid_stream_frees_the_engine(stack):
    async def main():
        async with oai(stack) as c:
            stream = await c.completions.create(model="tiny-moe", prompt="class A:", max_tokens=200,
                                                stream=True, extra_body={"ignore_eos": True})
            n = 0
            async for _ in stream:
                n += 1
                if n == 3:
                    break
            await stream.close()
        deadline = time.monotonic() + 15
        text = ""
        while time.monotonic() < deadline:
            _, text = await _get(stack, "/metrics")
            if (_gauge_sum(text, "planaria_num_requests_running") == 0
                    and _gauge_sum(text, "planaria_num_requests_waiting") == 0
                    and "planaria_http_requests_in_flight 0" in text):
                break
            await asyncio.sleep(0.2)
        assert _gauge_sum(text, "planaria_num_requests_running") == 0, text
        assert 'planaria_request_success_total{finished_reason="abort"}' in text
    run(main())


def test_metrics_exposition(stack):
    async def main():
        status, text = await _get(stack, "/metrics")
        assert status == 200
        for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
            assert f"# TYPE planaria_{name} histogram" in text
            count = re.search(rf"^planaria_{name}_count (\d+)$", text, re.M)
            assert count and int(count.group(1)) > 0
        for e in range(NUM_ENGINES):
            for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
                assert re.search(rf'^planaria_{g}{{engine="{e}"}} \S+$', text, re.M)
            assert f'planaria_engine_healthy{{engine="{e}"}} 1' in text
        assert "planaria_engine_deaths_total 0" in text
        assert re.search(r'^planaria_request_success_total\{finished_reason="length"\} (\d+)', text, re.M)
    run(main())


def test_stop_string_cuts_the_text(stack):
    async def main():
        async with oai(stack) as c:
            kw = dict(model="tiny-moe", prompt="def main():", max_tokens=16, temperature=0,
                      extra_body={"ignore_eos": True})
            full = (await c.completions.create(**kw)).choices[0].text
            stop = full[len(full) // 2:len(full) // 2 + 3]
            assert len(stop.strip()) > 0, full
            r = await c.completions.create(stop=[stop], **kw)
            ch = r.choices[0]
            assert ch.finish_reason == "stop" and ch.text == full[:full.index(stop)]
            assert getattr(ch, "stop_reason", None) == stop and r.usage.completion_tokens < 16
            stream = await c.completions.create(stop=[stop], stream=True, **kw)
            assert "".join([x.choices[0].text async for x in stream if x.choices]) == ch.text
    run(main())


def test_sigterm_drains_in_flight_streams(stack):
    """Last: SIGTERM the frontend while a stream runs; the stream still ends normally."""
    async def main():
        async with oai(stack) as c:
            stream = await c.completions.create(model="tiny-moe", prompt="x = [", max_tokens=60, stream=True,
                                                extra_body={"ignore_eos": True},
                                                stream_options={"include_usage": True})
            n, finish, usage = 0, None, None
            async for chunk in stream:
                n += 1
                if n == 2:
                    stack.frontend.send_signal(signal.SIGTERM)
                usage = chunk.usage or usage
                for ch in chunk.choices:
                    finish = ch.finish_reason or finish
            assert finish == "length" and usage.completion_tokens == 60
        with pytest.raises(aiohttp.ClientConnectionError):  # no longer listening
            await _get(stack, "/health")
    run(main())
    assert stack.frontend.wait(15) == 0
