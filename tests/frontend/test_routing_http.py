"""The HTTP side of KV-aware routing (docs/routing.md): ``cache_salt`` in the completion and
chat bodies (validated, carried to the engine request), and /metrics without the API key
(when one is set) showing nothing that tells how much of a prompt an engine had cached."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from planaria.engine.messages import SchedulerStats
from tests.frontend._fake_server import serve_fake
from tests.frontend._fakes import FakeEngineClient, FakeEngineInfo

KEY = "k-123"
CACHE_METRICS = ("planaria_engine_prefill_tokens", "planaria_prefix_cache_hit_rate", "planaria_engine_cached_blocks",
                 "planaria_routed_prefix_hit_rate", "planaria_routing_decisions_total")


async def _post(base: str, path: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s:
        async with s.post(base + path, json=body, headers=headers) as r:
            return r.status, await r.json()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "fake", "prompt": "hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
def test_cache_salt_reaches_the_engine_request_and_bad_ones_are_400(path, body):
    async def run():
        client = FakeEngineClient()
        async with serve_fake(client) as served:
            status, _ = await _post(served.base, path, {**body, "cache_salt": "tenant-a"})
            assert status == 200
            assert [r.cache_salt for r in client.requests.values()] == ["tenant-a"]
            for bad in ("", 7, "x" * 257, ["a"]):
                status, err = await _post(served.base, path, {**body, "cache_salt": bad})
                assert status == 400 and err["error"]["param"] == "cache_salt", (bad, err)
            status, _ = await _post(served.base, path, {**body, "cache_salt": "x" * 256})
            assert status == 200
            assert len(client.requests) == 2  # the bad ones never reached an engine

    asyncio.run(run())


def test_metrics_without_the_key_leave_out_the_cache_figures():
    async def run():
        client = FakeEngineClient()
        client.engines.append(FakeEngineInfo(1, stats=SchedulerStats(num_prefill_tokens=42), num_cached_blocks=3))
        async with serve_fake(client, api_key=KEY) as served:
            status, _ = await _post(served.base, "/v1/completions",
                                    {"model": "fake", "prompt": "hi", "max_tokens": 2}, key=KEY)
            assert status == 200
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{served.base}/metrics") as r:
                    assert r.status == 200  # open (no --api-key-protects-metrics) ...
                    open_text = await r.text()
                async with s.get(f"{served.base}/metrics", headers={"Authorization": f"Bearer {KEY}"}) as r:
                    keyed_text = await r.text()
            assert "planaria_num_requests_running" in open_text  # ... but without the cache figures
            for name in CACHE_METRICS:
                assert name not in open_text, name
                assert name in keyed_text, name
            assert 'planaria_engine_cached_blocks{engine="1"} 3' in keyed_text
            assert 'planaria_routing_decisions_total{reason="no_prefix"} 1' in keyed_text

    asyncio.run(run())


def test_metrics_without_an_api_key_show_everything():
    async def run():
        async with serve_fake(FakeEngineClient()) as served:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{served.base}/metrics") as r:
                    text = await r.text()
            for name in CACHE_METRICS:
                assert name in text, name

    asyncio.run(run())
