"""The frontend's guards on real loopback sockets over a fake engine client: API key,
in-flight bound (429 + Retry-After), engine error codes, request deadline, slow and large
bodies, the connection cap, JSON depth, and rendering off the event loop. The real
engines are in test_http_hardening.py and test_http_fuzz.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import aiohttp
import pytest

from tests.frontend._fake_server import serve_fake
from tests.frontend._fakes import FakeEngineClient, FakeTokenizer


class SlowTemplateTokenizer(FakeTokenizer):
    """A chat template that spins in Python (as a heavy Jinja template does) when a message
    says "slow"."""

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s

    def apply_chat_template(self, messages, **kw) -> str:
        if any(m["content"] == "slow" for m in messages):
            end = time.monotonic() + self.spin_s
            while time.monotonic() < end:
                sum(range(1000))
        return super().apply_chat_template(messages, **kw)


@contextlib.asynccontextmanager
async def serve(client: FakeEngineClient, tokenizer=None, render_timeout_s: float = 20.0, **limits):
    async with serve_fake(client, tokenizer, render_timeout_s, **limits) as s:
        yield s.server, s.base, s.port


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def post(s: aiohttp.ClientSession, url: str, body, headers=None) -> tuple[int, dict, dict]:
    async with s.post(url, json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


def test_api_key_guards_v1_and_optionally_metrics_but_never_health():
    async def main():
        async with serve(FakeEngineClient(), api_key="s3cret") as (_, base, _):
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "x", "max_tokens": 2}
                status, headers, err = await post(s, f"{base}/v1/completions", body)
                assert status == 401 and err["error"]["code"] == "invalid_api_key" and err["error"]["message"]
                assert headers["WWW-Authenticate"] == "Bearer"
                status, _, err = await post(s, f"{base}/v1/completions", body, {"Authorization": "Bearer wrong"})
                assert status == 401 and "incorrect" in err["error"]["message"]
                status, _, ok = await post(s, f"{base}/v1/completions", body, {"Authorization": "Bearer s3cret"})
                assert status == 200 and ok["choices"][0]["text"]
                assert (await s.get(f"{base}/v1/models")).status == 401
                for path, body, want in (("/tokenize", {"prompt": "ab"}, {"count": 2, "max_model_len": 64,
                                                                          "tokens": [97, 98], "token_strs": None}),
                                         ("/detokenize", {"tokens": [97, 98]}, {"prompt": "ab"})):
                    assert (await post(s, base + path, body))[0] == 401, path
                    assert (await post(s, base + path, body, {"Authorization": "Bearer s3cret"}))[::2] == (200, want)
                for path in ("/health", "/ready", "/metrics"):  # open by default
                    assert (await s.get(base + path)).status == 200, path
        async with serve(FakeEngineClient(), api_key="k", api_key_protects_metrics=True) as (_, base, _):
            async with aiohttp.ClientSession() as s:
                assert (await s.get(f"{base}/health")).status == 200
                for path in ("/ready", "/metrics"):
                    assert (await s.get(base + path)).status == 401, path
                    assert (await s.get(base + path, headers={"Authorization": "Bearer k"})).status == 200
    run(main())


def test_inflight_bound_answers_429_with_retry_after_and_frees_on_finish():
    async def main():
        client = FakeEngineClient(step_s=0.02)
        async with serve(client, max_inflight_requests=2) as (server, base, _):
            async with aiohttp.ClientSession() as s:
                slow = [asyncio.create_task(post(s, f"{base}/v1/completions", {"prompt": "x", "max_tokens": 40}))
                        for _ in range(2)]
                while server.num_in_flight < 2:
                    await asyncio.sleep(0.01)
                status, headers, err = await post(s, f"{base}/v1/completions", {"prompt": "x", "max_tokens": 1})
                assert status == 429 and headers["Retry-After"] == "1"
                assert err["error"]["type"] == "rate_limit_error" and "max-inflight-requests" in err["error"]["message"]
                assert [r[0] for r in await asyncio.gather(*slow)] == [200, 200]
                status, _, _ = await post(s, f"{base}/v1/completions", {"prompt": "x", "max_tokens": 1})
                assert status == 200
    run(main())


@pytest.mark.parametrize("code, status, err_type", [
    ("overloaded", 429, "rate_limit_error"), ("invalid_request", 400, "invalid_request_error"),
    ("internal", 500, "internal_server_error"), ("some_future_code", 500, "internal_server_error")])
def test_engine_error_codes_map_to_statuses(code, status, err_type):
    async def main():
        async with serve(FakeEngineClient(error="no", error_code=code)) as (_, base, _):
            async with aiohttp.ClientSession() as s:
                got, headers, err = await post(s, f"{base}/v1/completions", {"prompt": "x", "max_tokens": 3})
                assert (got, err["error"]["type"]) == (status, err_type) and err["error"]["message"]
                assert ("Retry-After" in headers) == (status == 429)
    run(main())


def test_request_deadline_aborts_in_engine_504_or_sse_error():
    async def main():
        client = FakeEngineClient(step_s=0.05)
        async with serve(client, request_timeout_s=0.5) as (server, base, _):
            async with aiohttp.ClientSession() as s:
                t0 = time.monotonic()
                status, _, err = await post(s, f"{base}/v1/completions", {"prompt": "x", "max_tokens": 1000})
                assert status == 504 and err["error"]["code"] == "request_timeout"
                assert time.monotonic() - t0 < 10
                async with s.post(f"{base}/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000, "stream": True}) as r:
                    assert r.status == 200
                    raw = (await r.read()).decode()
            events = [e[len("data: "):] for e in raw.split("\n\n") if e]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
            for _ in range(100):
                if not client.running:
                    break
                await asyncio.sleep(0.02)
            assert not client.running and len(client.aborted) == 2 and server.num_in_flight == 0
    run(main())


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_body_is_408_and_closed_large_body_413_deep_json_400():
    async def main():
        async with serve(FakeEngineClient(), body_read_timeout_s=1.5, max_body_bytes=1000) as (_, base, port):
            def slowloris() -> bytes:
                with _connect(port) as sock:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 500\r\n\r\n{\"prompt\": ")
                    for _ in range(3):  # a byte now and then, never the whole body
                        time.sleep(0.2)
                        sock.sendall(b" ")
                    return _read_all(sock)  # returns at EOF: the server closed the connection

            t0 = time.monotonic()
            reply = await asyncio.to_thread(slowloris)
            assert reply.startswith(b"HTTP/1.1 408") and b"body-read-timeout-s" in reply
            assert time.monotonic() - t0 < 10
            async with aiohttp.ClientSession() as s:
                status, headers, err = await post(s, f"{base}/v1/completions", {"prompt": "x" * 2000})
                assert status == 413 and "max-body-bytes" in err["error"]["message"]
                deep = b'{"prompt": "x", "response_format": ' + b"[" * 200 + b"]" * 200 + b"}"
                async with s.post(f"{base}/v1/completions", data=deep) as r:
                    err = await r.json()
                    assert r.status == 400 and "nests" in err["error"]["message"]
                assert (await s.get(f"{base}/health")).status == 200
    run(main())


def test_connections_beyond_the_cap_are_refused_and_served_ones_go_on():
    """At the cap with every connection in the middle of a request: the next one is 503
    and closed, the served ones go on. (An idle or head-less connection would give its
    slot to the newcomer instead: tests/frontend/test_hostile_http.py.)"""
    body = json.dumps({"prompt": "x", "max_tokens": 30, "stream": True}).encode()
    stream = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body

    async def main():
        async with serve(FakeEngineClient(step_s=0.05), max_connections=3) as (server, base, port):
            held = [await asyncio.to_thread(_connect, port) for _ in range(3)]
            try:
                for sock in held:
                    sock.sendall(stream)
                await asyncio.sleep(0.2)  # the three are accepted and streaming
                extra = await asyncio.to_thread(_connect, port)
                with extra:
                    reply = await asyncio.to_thread(_read_all, extra)
                assert reply.startswith(b"HTTP/1.1 503") and b"too_many_connections" in reply
                # the held streams are still served, to their end
                for sock in held:
                    answer = await asyncio.to_thread(_read_all, sock)
                    assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer
            finally:
                for sock in held:
                    sock.close()
            await asyncio.sleep(0.3)  # the server sees them close
            async with aiohttp.ClientSession() as s:
                assert (await s.get(f"{base}/health")).status == 200
    run(main())


def test_health_answers_fast_while_a_slow_render_runs_and_the_render_times_out():
    async def main():
        tok = SlowTemplateTokenizer(spin_s=4.0)
        async with serve(FakeEngineClient(), tokenizer=tok, render_timeout_s=1.5) as (_, base, _):
            async with aiohttp.ClientSession() as s:
                slow = asyncio.create_task(post(s, f"{base}/v1/chat/completions",
                                                {"messages": [{"role": "user", "content": "slow"}]}))
                await asyncio.sleep(0.2)
                worst = 0.0
                for _ in range(5):
                    t0 = time.monotonic()
                    async with s.get(f"{base}/health") as r:
                        assert r.status == 200
                    worst = max(worst, time.monotonic() - t0)
                    await asyncio.sleep(0.1)
                assert worst < 1.0, worst  # a render on the event loop would hold /health for 4 s
                status, _, err = await slow
                assert status == 503 and err["error"]["code"] == "render_timeout"
                status, _, ok = await post(s, f"{base}/v1/chat/completions",
                                           {"messages": [{"role": "user", "content": "fast"}], "max_tokens": 2})
                assert status == 200 and ok["choices"][0]["message"]["content"]
    run(main())
