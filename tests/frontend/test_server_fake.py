"""The HTTP server over a fake engine client: real aiohttp on loopback, the official openai
client, a character tokenizer. Covers the response shapes and fault paths quickly; the
real engine processes are in test_http.py."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import openai
import pytest
from aiohttp import web

from planaria.frontend.generation import Generator
from planaria.frontend.metrics import FrontendMetrics
from planaria.frontend.server import FrontendServer
from planaria.frontend.serving import ModelInfo, OpenAIServing
from tests.frontend._fakes import EOS, VOCAB, FakeEngineClient, FakeTokenizer, detokenizer


@contextlib.asynccontextmanager
async def serve(client: FakeEngineClient, max_model_len: int = 64, max_replays: int | None = None):
    from planaria.frontend.journal import RequestJournal

    tok = FakeTokenizer()
    metrics = FrontendMetrics("fake")
    journal = RequestJournal(max_replays=max_replays) if max_replays is not None else None
    # a request finding no engine waits this long for one (30 s by default)
    gen = Generator(client, detokenizer(tok), metrics, journal=journal,
                    replay_wait_s=0.5)
    model = ModelInfo(name="fake", path="/models/fake", vocab_size=VOCAB, max_model_len=max_model_len,
                      eos_token_id=EOS)
    server = FrontendServer(client, OpenAIServing(gen, tok, model), metrics)
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    base = f"http://{host}:{port}"
    oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    try:
        yield server, oai, base
    finally:
        await oai.close()
        await runner.cleanup()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_completion_non_stream_shape_and_usage():
    async def main():
        async with serve(FakeEngineClient("abc")) as (_, oai, _):
            r = await oai.completions.create(model="fake", prompt="hey", max_tokens=5)
            assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "fake"
            assert r.choices[0].text == "abcab" and r.choices[0].finish_reason == "length"
            assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)
            assert r.created > 0
    run(main())


def test_completion_stream_batch_echo_and_usage():
    async def main():
        async with serve(FakeEngineClient("xy")) as (_, oai, _):
            stream = await oai.completions.create(model="fake", prompt=["p1", "p2"], max_tokens=4, stream=True,
                                                  echo=True, stream_options={"include_usage": True})
            texts, finish, usage = {0: "", 1: ""}, {}, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    texts[c.index] += c.text
                    if c.finish_reason:
                        finish[c.index] = c.finish_reason
            assert texts == {0: "p1xyxy", 1: "p2xyxy"} and finish == {0: "length", 1: "length"}
            assert (usage.prompt_tokens, usage.completion_tokens) == (4, 8)
    run(main())


def test_stop_string_finishes_and_aborts_the_engine_request():
    async def main():
        client = FakeEngineClient("one two three ")
        async with serve(client) as (_, oai, _):
            r = await oai.completions.create(model="fake", prompt="x", max_tokens=40, stop=["two"])
            assert r.choices[0].text == "one " and r.choices[0].finish_reason == "stop"
            assert getattr(r.choices[0], "stop_reason", None) == "two"
            assert r.usage.completion_tokens == 7
            stream = await oai.completions.create(model="fake", prompt="x", max_tokens=40, stop="two",
                                                  stream=True, extra_body={"include_stop_str_in_output": True})
            text = "".join([c.choices[0].text async for c in stream if c.choices])
            assert text == "one two"
            for _ in range(250):  # the abort follows the last chunk: wait for it, 5 s at most
                if len(client.aborted) == 2:
                    break
                await asyncio.sleep(0.02)
            assert not client.running and len(client.aborted) == 2
    run(main())


def test_completion_logprobs_format():
    async def main():
        async with serve(FakeEngineClient("ab")) as (_, oai, _):
            r = await oai.completions.create(model="fake", prompt="x", max_tokens=3, logprobs=2)
            lp = r.choices[0].logprobs
            assert lp.tokens == ["a", "b", "a"] and lp.token_logprobs == [-0.5] * 3
            assert lp.text_offset == [0, 1, 2]
            assert lp.top_logprobs[0] == {"a": -1.0, "b": -2.0}
    run(main())


def test_chat_stream_and_logprobs():
    async def main():
        async with serve(FakeEngineClient("hi!")) as (_, oai, _):
            stream = await oai.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "yo"}], max_tokens=3, stream=True,
                logprobs=True, top_logprobs=1)
            chunks = [c async for c in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert all(c.id == chunks[0].id and c.id.startswith("chatcmpl-") for c in chunks)
            assert chunks[0].object == "chat.completion.chunk"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert text == "hi!" and chunks[-1].choices[0].finish_reason == "length"
            lps = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
            assert [t.token for t in lps] == ["h", "i", "!"]
            assert lps[0].bytes == [104] and len(lps[0].top_logprobs) == 1
            r = await oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "yo"}],
                                                  max_completion_tokens=2)
            assert r.choices[0].message.content == "hi" and r.choices[0].message.role == "assistant"
            assert r.usage.prompt_tokens == len("<user>yo\n<assistant>")
    run(main())


def test_bad_bodies_are_400_with_reasons():
    async def main():
        async with serve(FakeEngineClient()) as (_, oai, base):
            with pytest.raises(openai.BadRequestError) as ei:
                await oai.completions.create(model="fake", prompt="x", max_tokens=-1)
            assert "max_tokens" in str(ei.value) and ei.value.body["param"] == "max_tokens"
            with pytest.raises(openai.BadRequestError, match="maximum context length is 64"):
                await oai.completions.create(model="fake", prompt="x" * 64)
            with pytest.raises(openai.BadRequestError, match="tools"):
                await oai.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                                  tools=[{"type": "function", "function": {"name": "f g"}}])
            with pytest.raises(openai.NotFoundError):
                await oai.completions.create(model="other", prompt="x")
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{base}/v1/completions", data=b"{nope") as r:
                    body = await r.json()
                    assert r.status == 400 and body["error"]["type"] == "invalid_request_error"
                async with s.get(f"{base}/v1/nothing") as r:
                    assert r.status == 404 and "error" in await r.json()
    run(main())


def test_engine_refusal_is_400_and_death_is_503_or_stream_error():
    async def main():
        async with serve(FakeEngineClient(error="structured output is not supported")) as (_, oai, _):
            with pytest.raises(openai.BadRequestError, match="structured output"):
                await oai.completions.create(model="fake", prompt="x", extra_body={"guided_regex": "a"})
        client = FakeEngineClient(die_after=3)
        # Replay disabled: what a client sees when an engine death cannot be replayed.
        async with serve(client, max_replays=0) as (server, oai, base):
            with pytest.raises(openai.InternalServerError) as ei:
                await oai.completions.create(model="fake", prompt="x", max_tokens=10)
            assert ei.value.status_code == 503
            stream = await oai.completions.create(model="fake", prompt="x", max_tokens=10, stream=True)
            got = ""
            with pytest.raises(openai.APIError, match="engine"):
                async for c in stream:
                    got += c.choices[0].text
            assert got == "hel"
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 9,
                                                                  "stream": True}) as r:
                    raw = (await r.read()).decode()
            events = [e[len("data: "):] for e in raw.split("\n\n") if e]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead"
            assert "planaria_request_errors_total{kind=\"replay_limit\"} 3" in server.metrics.render()
    run(main())


def test_client_disconnect_aborts_in_engine():
    async def main():
        client = FakeEngineClient(step_s=0.01)
        async with serve(client) as (server, oai, _):
            stream = await oai.completions.create(model="fake", prompt="x", max_tokens=1000, stream=True)
            n = 0
            async for _ in stream:
                n += 1
                if n == 3:
                    break
            await stream.close()
            for _ in range(100):
                if not client.running and server.num_in_flight == 0:
                    break
                await asyncio.sleep(0.02)
            assert not client.running and len(client.aborted) == 1 and server.num_in_flight == 0
    run(main())


def test_health_ready_models_metrics():
    async def main():
        client = FakeEngineClient()
        async with serve(client) as (server, oai, base):
            models = await oai.models.list()
            assert [m.id for m in models.data] == ["fake"]
            await oai.completions.create(model="fake", prompt="x", max_tokens=4)
            async with aiohttp.ClientSession() as s:
                assert (await s.get(f"{base}/health")).status == 200
                assert (await s.get(f"{base}/ready")).status == 200
                client.engines[0].state = "dead"
                r = await s.get(f"{base}/ready")
                assert r.status == 503 and (await r.json())["num_healthy_engines"] == 0
                with pytest.raises(openai.InternalServerError):
                    await oai.completions.create(model="fake", prompt="x")
                text = await (await s.get(f"{base}/metrics")).text()
            assert "planaria_engine_deaths_total 1" in text
            assert 'planaria_request_success_total{finished_reason="length"} 1' in text
            assert "planaria_time_to_first_token_seconds_count 1" in text
            assert "planaria_inter_token_latency_seconds_count 3" in text
            assert 'planaria_e2e_request_latency_seconds_bucket{le="+Inf"} 1' in text
            assert 'planaria_num_requests_running{engine="0"} 0' in text
            assert 'planaria_kv_cache_usage_perc{engine="0"} 0' in text
            assert 'planaria_request_errors_total{kind="no_engine"} 1' in text
            server.draining = True
            client.engines[0].state = "running"
            async with aiohttp.ClientSession() as s:
                assert (await s.get(f"{base}/ready")).status == 503
    run(main())
