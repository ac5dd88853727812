"""Hostile clients against the frontend's HTTP layer, on real loopback sockets over a fake
engine: bodies that made the JSON depth scan quadratic, connections that never finish
their request head or crowd the connection slots from one address, request ids and
Authorization bytes that broke the response. Each test names the hole it closes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time

import aiohttp
import pytest

import planaria.frontend.limits as limits_mod
from planaria.frontend.errors import RequestError
from planaria.frontend.limits import check_json_depth, json_depth
from tests.frontend._fake_server import serve_fake
from tests.frontend._fakes import FakeEngineClient

MIB = 2**20


@contextlib.asynccontextmanager
async def serve(client: FakeEngineClient, **limits):
    async with serve_fake(client, **limits) as s:
        yield s.site, s.port


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def connect(port: int, source: str = "127.0.0.1"):
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def read_to_eof(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything until the server closes; TimeoutError if it has not within ``timeout_s``."""
    return await asyncio.wait_for(reader.read(), timeout_s)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    """One Content-Length or chunked HTTP/1.1 response off a kept-alive connection."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in head[1:] if line)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readuntil(b"\r\n")
    return status, headers, body


HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


def post(path: str, body: dict | bytes, extra: bytes = b"") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n").encode() + extra + b"\r\n" + data


# -- 1. the JSON depth scan ----------------------------------------------------------------
HOSTILE_BODIES = {  # name: size -> body
    "unclosed string of escaped quotes": lambda n: b"[" * 40 + b'"' + b'\\"' * ((n - 41) // 2),
    "unclosed string, trailing backslash": lambda n: b"[" * 40 + b'"' + b"a" * (n - 42) + b"\\",
    "a run of backslashes": lambda n: b"[" * 40 + b'"' + b"\\" * (n - 41),
    "only quotes": lambda n: b"[" * 40 + b'"' * (n - 40),
    "alternating bracket, escaped quote": lambda n: b"[" * 40 + b'[\\"' * ((n - 40) // 3),
    "nesting behind many strings": lambda n: b'"x",' * (n // 8) + b"[" * (n // 2),
    "short strings": lambda n: b"[" * 40 + b'"a",' * ((n - 40) // 4),
    "brackets only": lambda n: b"[]" * (n // 2),
}


@pytest.mark.parametrize("shape", list(HOSTILE_BODIES))
def test_json_depth_scan_of_a_4_mib_hostile_body_is_fast(shape):
    """The old regex (strings cut out by backtracking) spent 3 s on 32 KiB of an unclosed
    string of escaped quotes, hours on 4 MiB."""
    body = HOSTILE_BODIES[shape](4 * MIB)
    t0 = time.perf_counter()
    with contextlib.suppress(RequestError):
        check_json_depth(body, 32)
    # ~40 ms here; the bound only separates linear from quadratic (hours) on a busy CI host
    assert time.perf_counter() - t0 < 5.0


def _nesting(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_nesting, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_nesting, value.values()), default=0)
    return 0


def _random_json(rng: random.Random, max_level: int, level: int = 0):
    def text() -> str:  # the characters that matter to the scan, in strings and keys
        return "".join(rng.choice('[]{}"\\ aé\n\x00') for _ in range(rng.randint(0, 6)))

    r = rng.random()
    if level >= max_level or r < 0.3:
        return rng.choice([text(), 1, None, True, 2.5])
    if r < 0.65:
        return [_random_json(rng, max_level, level + 1) for _ in range(rng.randint(0, 4))]
    return {text(): _random_json(rng, max_level, level + 1) for _ in range(rng.randint(0, 4))}


@pytest.mark.parametrize("chunk_bytes", [2**16, 1, 2, 3, 7])
def test_json_depth_is_the_nesting_of_valid_json_brackets_in_strings_do_not_count(monkeypatch, chunk_bytes):
    """Small slices put every quote, backslash run and bracket on a slice's edge."""
    monkeypatch.setattr(limits_mod, "_SCAN_CHUNK_BYTES", chunk_bytes)
    rng = random.Random(chunk_bytes)
    for _ in range(300 if chunk_bytes > 8 else 60):
        value = _random_json(rng, 12 if chunk_bytes > 8 else 6)
        for body in (json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode()):
            assert json_depth(body) == _nesting(value), body
    for body, depth in ((b'{"s": "\\\\"}', 1), (b'["\\\\\\"[[[", [[]]]', 3), (b'"\\\\\\\\"[[', 2),
                        (b'{"a": [[1, 2], [3]], "s": "[[[[[[[[[[[["}', 3), (b"", 0), (b'"[[[', 0)):
        assert json_depth(body) == depth, body
    with pytest.raises(RequestError, match="deeper than 3"):
        check_json_depth(b'{"a": [[[1]]], "b": "]]]]]]"}', 3)


def test_a_4_mib_hostile_body_is_400_and_the_loop_keeps_answering():
    """Large bodies are scanned on a thread: /health answers meanwhile."""
    async def main():
        async with serve(FakeEngineClient()) as (_, port):
            body = HOSTILE_BODIES["unclosed string of escaped quotes"](4 * MIB - 64)
            async with aiohttp.ClientSession() as s:
                async def hostile():
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions", data=body) as r:
                        return r.status, await r.json()

                tasks = [asyncio.create_task(hostile()) for _ in range(4)]
                worst = 0.0
                while not all(t.done() for t in tasks):
                    t0 = time.monotonic()
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        assert r.status == 200
                    worst = max(worst, time.monotonic() - t0)
                for status, err in await asyncio.gather(*tasks):
                    assert status == 400 and "nests" in err["error"]["message"]
                assert worst < 1.0, worst
    run(main())


# -- 5. the request head's timeout and the per-client connection cap -----------------------
def test_a_partial_head_gets_408_and_a_silent_connection_is_closed_after_the_head_timeout():
    async def main():
        async with serve(FakeEngineClient(), header_read_timeout_s=0.5) as (site, port):
            r1, w1 = await connect(port)
            r2, w2 = await connect(port)
            t0 = time.monotonic()
            w1.write(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: ")
            for _ in range(4):  # bytes keep coming, the head never ends: the timer is not reset
                await asyncio.sleep(0.1)
                w1.write(b"a")
            reply = await read_to_eof(r1, 5)
            assert reply.startswith(b"HTTP/1.1 408") and b"header-read-timeout-s" in reply
            assert b'"header_timeout"' in reply
            assert await read_to_eof(r2, 5) == b""  # nothing came: closed without a word
            assert 0.4 < time.monotonic() - t0 < 3
            for w in (w1, w2):
                w.close()
            await asyncio.sleep(0.1)
            assert site.num_connections == 0
    run(main())


def test_slots_held_by_idle_and_partial_heads_are_reaped_and_a_normal_client_is_served():
    """Every slot held by connections that never finish a head: a new connection takes the
    oldest one's slot at once (it gets 408), and the others are reaped at the head timeout.
    Only when every connection has a request in progress is a new one refused (503)."""
    async def main():
        async with serve(FakeEngineClient(step_s=0.05), max_connections=20, max_connections_per_client=0,
                         header_read_timeout_s=0.5) as (site, port):
            held = [await connect(port) for _ in range(20)]
            for _, w in held[:10]:
                w.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
            await asyncio.sleep(0.1)
            async with aiohttp.ClientSession() as s:  # served at once: the oldest idle slot is taken
                async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                                  json={"prompt": "x", "max_tokens": 3}) as resp:
                    assert resp.status == 200 and (await resp.json())["choices"][0]["text"]
            replies = await asyncio.gather(*(read_to_eof(r, 5) for r, _ in held))
            assert all(x.startswith(b"HTTP/1.1 408") for x in replies[:10]) and replies[10:] == [b""] * 10
            for _, w in held:
                w.close()
            await asyncio.sleep(0.1)
            assert site.num_connections == 0
            # 20 connections each with a request in progress: nothing to evict, 503
            body = json.dumps({"prompt": "x", "max_tokens": 40, "stream": True}).encode()
            busy = [await connect(port) for _ in range(20)]
            for _, w in busy:
                w.write(post("/v1/completions", body))
            await asyncio.sleep(0.3)
            r, w = await connect(port)
            full = await read_to_eof(r, 5)
            assert full.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in full
            w.close()
            for _, w in busy:
                w.close()
    run(main())


def test_the_head_timer_spares_keep_alive_pipelining_slow_bodies_and_long_streams():
    async def main():
        client = FakeEngineClient(step_s=0.05)
        async with serve(client, header_read_timeout_s=0.5, body_read_timeout_s=10) as (_, port):
            r, w = await connect(port)
            # a head in pieces, inside the timeout
            for piece in (b"GET /health HTTP/1.1\r\n", b"Host: t\r\n", b"\r\n"):
                w.write(piece)
                await asyncio.sleep(0.1)
            assert (await read_response(r))[0] == 200
            await asyncio.sleep(1.0)  # idle between requests: the keep-alive timeout's, not the head's
            w.write(HEALTH * 100)  # pipelined, past aiohttp's queue of 32 (it pauses reading, then parses on)
            assert [(await read_response(r))[0] for _ in range(100)] == [200] * 100
            await asyncio.sleep(0.7)  # past the head timeout, idle: still open
            w.write(HEALTH)
            assert (await read_response(r))[0] == 200
            # a body that takes longer than the head timeout (the body read timeout's)
            body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
            w.write(post("/v1/completions", body)[:-len(body)])
            for i in range(0, len(body), 8):
                await asyncio.sleep(0.1)
                w.write(body[i:i + 8])
            assert (await read_response(r))[0] == 200
            # a stream that runs 2 s, while the client sends the start of its next head
            w.write(post("/v1/completions", {"prompt": "x", "max_tokens": 40, "stream": True}))
            await asyncio.sleep(0.2)
            w.write(b"GET /health HTTP/1.1\r\n")
            status, _, events = await read_response(r)
            assert status == 200 and events.count(b"data: ") >= 41 and events.endswith(b"data: [DONE]\n\n")
            w.write(b"Host: t\r\n\r\n")  # the rest of that head: served
            assert (await read_response(r))[0] == 200
            # a later request's head that never ends is timed from its first byte
            await asyncio.sleep(0.7)
            t0 = time.monotonic()
            w.write(b"GET /health HTTP/1.1\r\n")
            reply = await read_to_eof(r, 5)
            assert reply.startswith(b"HTTP/1.1 408") and 0.4 < time.monotonic() - t0 < 3
            w.close()
    run(main())


def test_connections_per_client_address_are_capped_and_other_addresses_go_on():
    async def main():
        async with serve(FakeEngineClient(), max_connections=10, max_connections_per_client=3,
                         header_read_timeout_s=30) as (site, port):
            mine = [await connect(port) for _ in range(3)]
            r, w = await connect(port)
            reply = await read_to_eof(r, 5)
            assert reply.startswith(b"HTTP/1.1 503") and b'"too_many_connections_from_client"' in reply
            assert b"max-connections-per-client" in reply
            w.close()
            other_r, other_w = await connect(port, source="127.0.0.2")  # another address
            other_w.write(HEALTH)
            assert (await read_response(other_r))[0] == 200
            mine[0][1].write(HEALTH)  # the capped address's own connections are served
            assert (await read_response(mine[0][0]))[0] == 200
            mine[1][1].close()
            await asyncio.sleep(0.1)
            r, w = await connect(port)  # a slot of its own came free
            w.write(HEALTH)
            assert (await read_response(r))[0] == 200
            for _, x in [*mine, (r, w), (other_r, other_w)]:
                x.close()
            await asyncio.sleep(0.1)
            assert site.num_connections == 0
    run(main())


# -- 9. values echoed into headers, header bytes -------------------------------------------
def test_a_non_utf8_authorization_header_is_401_without_a_traceback(caplog):
    async def main():
        async with serve(FakeEngineClient(), api_key="s3cret-é") as (_, port):
            r, w = await connect(port)
            for auth in (b"Bearer \xff\xfe", b"Bearer s3cret-\xe9", b"Bearer s3cret-\xc3\xa9"):
                w.write(b"GET /v1/models HTTP/1.1\r\nHost: t\r\nAuthorization: " + auth + b"\r\n\r\n")
                status, headers, body = await read_response(r)
                if auth.endswith(b"\xc3\xa9"):  # the key's own UTF-8 bytes
                    assert status == 200
                else:
                    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
                    assert headers["www-authenticate"] == "Bearer"
            w.close()
    with caplog.at_level(logging.WARNING):
        run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("request_id", ["a\r\nSet-Cookie: x=1", "abc\n", "x" * 10_000, "a b", "id-é", "\x00"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_id_that_cannot_be_a_header_is_400_before_any_engine_work(request_id, path):
    async def main():
        client = FakeEngineClient()
        body = {"max_tokens": 2, "stream": True, "request_id": request_id,
                **({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})}
        async with serve(client) as (_, port):
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
                    err = await r.json()
                assert r.status == 400 and err["error"]["param"] == "request_id"
        assert client.requests == {}
    run(main())


def test_a_valid_request_id_is_echoed_in_the_header_and_the_body():
    async def main():
        rid = "req-" + "".join(chr(c) for c in range(0x21, 0x7F)).replace('"', "") + "x" * 10
        rid = rid[:256]
        async with serve(FakeEngineClient()) as (_, port):
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "x", "max_tokens": 2, "stream": True, "request_id": rid}
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    assert r.status == 200 and r.headers["X-Request-Id"] == rid
                    assert json.loads((await r.read()).split(b"\n\n")[0][len(b"data: "):])["id"] == rid
    run(main())
