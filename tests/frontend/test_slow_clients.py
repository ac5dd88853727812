"""Clients that stop reading: a stream whose client takes no data is cut off after the
write deadline (``--write-timeout-s``), its engine request aborted and its admission slot
freed, while other clients are served. Real loopback sockets, a fake engine."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import socket

import aiohttp

from tests.frontend._fake_server import serve_fake
from tests.frontend._fakes import FakeEngineClient

MAX_MODEL_LEN = 1_000_000


@contextlib.asynccontextmanager
async def serve(client: FakeEngineClient, **limits):
    async with serve_fake(client, max_model_len=MAX_MODEL_LEN, **limits) as s:
        yield s.server, s.port


def stream_request(max_tokens: int, logprobs: int = 5) -> bytes:
    body = json.dumps({"prompt": "x", "max_tokens": max_tokens, "stream": True, "logprobs": logprobs}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


async def open_non_reader(port: int, request: bytes) -> socket.socket:
    """A client that sends a request and never reads a byte of the answer."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
    await asyncio.get_running_loop().sock_sendall(s, request)
    return s


def test_a_stream_whose_client_stopped_reading_is_aborted_and_frees_its_slot():
    async def main():
        client = FakeEngineClient(step_s=0.0)
        async with serve(client, write_timeout_s=0.5, max_inflight_requests=4) as (server, port):
            sockets = [await open_non_reader(port, stream_request(500_000)) for _ in range(4)]
            try:
                loop = asyncio.get_running_loop()
                start = loop.time()
                while server.num_in_flight < 4 and loop.time() - start < 10:
                    await asyncio.sleep(0.01)
                assert server.num_in_flight == 4  # every slot held by a client that does not read
                # each is cut off once its buffers are full and a write waited 0.5 s
                while server.num_in_flight and loop.time() - start < 30:
                    await asyncio.sleep(0.05)
                assert server.num_in_flight == 0, "the slots stayed held by clients that never read"
                assert len(client.aborted) == 4 and not client.running
                async with aiohttp.ClientSession() as s:  # and the server serves others
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                                      json={"prompt": "x", "max_tokens": 3}) as r:
                        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3
            finally:
                for s in sockets:
                    s.close()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_slow_but_steady_reader_gets_the_whole_stream():
    """The deadline is per write: a client that reads slowly, but reads, is never cut."""
    async def main():
        client = FakeEngineClient(step_s=0.0)
        async with serve(client, write_timeout_s=0.5) as (server, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(stream_request(3000))
            data = b""
            while not data.endswith(b"0\r\n\r\n"):
                chunk = await reader.read(16384)
                if not chunk:
                    break
                data += chunk
                await asyncio.sleep(0.02)  # slow, but well inside the deadline between reads
            assert b"data: [DONE]" in data and data.count(b'"text"') >= 3000
            assert not client.aborted
            writer.close()
    asyncio.run(asyncio.wait_for(main(), 60))


class BulkEngineClient(FakeEngineClient):
    """Outputs of ``chunk_tokens`` tokens each (so a client that does not read fills its
    buffers in a few dozen chunks, without a flood of tiny writes)."""

    def __init__(self, chunk_tokens: int, **kw) -> None:
        super().__init__(**kw)
        self.chunk_tokens = chunk_tokens

    async def generate(self, req):
        from planaria.engine.messages import EngineCoreOutput

        rid = req.request_id
        self.requests[rid] = req
        self.running.add(rid)
        finished = False
        try:
            total = req.sampling_params.max_tokens
            done = 0
            while done < total:
                await asyncio.sleep(self.step_s)
                n = min(self.chunk_tokens, total - done)
                done += n
                finished = done >= total
                yield EngineCoreOutput(request_id=rid, new_token_ids=[ord("a")] * n,
                                       finish_reason="length" if finished else None)
        finally:
            self.running.discard(rid)
            if not finished:
                self.aborted.append(rid)


def test_512_streams_that_never_read_and_1024_unfinished_heads_do_not_keep_a_normal_client_out():
    """An attack from many addresses (so the per-client cap alone does not stop it): 512
    streams whose clients never read (64 from each of 8 addresses) and 1024 connections
    that never finish their request head (64 from each of 16 others), with the default
    connection limits (1024 connections, 64 per address). A normal client keeps getting
    its answers the whole time: a connection that never sent a whole head loses its slot
    to one that sends a request (oldest first) or at the head timeout; the streams hold
    512 of the 1024 admission units. When the attackers go, every unit comes back."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4500:
        import pytest
        pytest.skip(f"needs 4500 file descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4500), hard))

    async def main():
        client = BulkEngineClient(chunk_tokens=200, step_s=0.2)
        async with serve(client, write_timeout_s=1.0, header_read_timeout_s=5.0,
                         max_inflight_requests=1024) as (server, port):
            loop = asyncio.get_running_loop()
            latencies: list[float] = []
            statuses: list[int] = []
            stop = asyncio.Event()

            async def normal_client():
                async with aiohttp.ClientSession() as s:
                    while not stop.is_set():
                        t0 = loop.time()
                        async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                                          json={"prompt": "x", "max_tokens": 3}) as r:
                            statuses.append(r.status)
                            await r.read()
                        latencies.append(loop.time() - t0)
                        await asyncio.sleep(0.1)

            async def raw(source: str, data: bytes) -> socket.socket:
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.setblocking(False)
                s.bind((source, 0))
                await loop.sock_connect(s, ("127.0.0.1", port))
                if data:
                    await loop.sock_sendall(s, data)
                return s

            normal = asyncio.create_task(normal_client())
            attack: list[socket.socket] = []
            try:
                for i in range(512):
                    attack.append(await raw(f"127.0.1.{1 + i // 64}", stream_request(4_000_000, logprobs=0)))
                for i in range(1024):
                    attack.append(await raw(f"127.0.2.{1 + i // 64}", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"))
                await asyncio.sleep(8.0)  # the unread streams hit the write deadline, heads the head timeout
                held = server.admission.in_flight
            finally:
                stop.set()
                await normal
                for s in attack:
                    s.close()
            assert statuses and set(statuses) == {200}, collections.Counter(statuses)
            assert len(statuses) >= 20 and max(latencies) < 5.0, (len(statuses), max(latencies))
            assert held >= 500  # the streams were admitted and running (their kernel buffers hold
            # about 3 MB each before a write waits; the first test shows the write deadline)
            for _ in range(100):
                if server.admission.in_flight == 0:
                    break
                await asyncio.sleep(0.05)
            assert server.admission.in_flight == 0 and not client.running
    asyncio.run(asyncio.wait_for(main(), 120))
