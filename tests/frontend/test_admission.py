"""Admission counts sequences, not HTTP requests; priority only for callers the operator
allows. Real loopback sockets over a fake engine client (tests/frontend/test_guards.py)."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.frontend._fakes import FakeEngineClient
from tests.frontend.test_guards import post, run, serve


def test_in_flight_bound_counts_each_requests_sequences():
    """Bound 8: a request of n = 6 holds 6; another of n = 4 is a 429 (10 > 8) although only
    one HTTP request is in flight (it used to be admitted: two requests of many sequences
    filled an engine's waiting queue); n = 2 fits; n = 9 can never fit: 400 naming n."""
    async def main():
        client = FakeEngineClient(step_s=0.02)
        async with serve(client, max_inflight_requests=8) as (server, base, _):
            async with aiohttp.ClientSession() as s:
                url = f"{base}/v1/completions"
                big = asyncio.create_task(post(s, url, {"prompt": "x", "max_tokens": 30, "n": 6}))
                while server.admission.in_flight < 6:
                    await asyncio.sleep(0.01)
                status, headers, err = await post(s, url, {"prompt": "x", "max_tokens": 1, "n": 4})
                assert status == 429 and headers["Retry-After"] == "1", err
                assert "sequences" in err["error"]["message"]
                status, _, body = await post(s, url, {"prompt": "x", "max_tokens": 1, "n": 2})
                assert status == 200 and len(body["choices"]) == 2
                status, _, err = await post(s, url, {"prompt": ["a", "b", "c"], "max_tokens": 1, "n": 3})
                assert status == 400 and err["error"]["param"] == "n", err
                status, _, body = await big
                assert status == 200 and len(body["choices"]) == 6
                assert server.admission.in_flight == 0  # every unit went back
                status, _, err = await post(s, f"{base}/v1/chat/completions",
                                            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                             "n": 9})
                assert status == 400 and err["error"]["param"] == "n"
                assert server.admission.in_flight == 0
    run(main())


def test_priority_only_for_allowed_callers():
    async def main():
        body = {"prompt": "x", "max_tokens": 1, "priority": 5}
        async with serve(FakeEngineClient()) as (_, base, _):
            async with aiohttp.ClientSession() as s:
                status, _, err = await post(s, f"{base}/v1/completions", body)
                assert status == 400 and err["error"]["param"] == "priority"
                status, _, _ = await post(s, f"{base}/v1/completions", body | {"priority": 0})
                assert status == 200
        client = FakeEngineClient()
        async with serve(client, priority_key="vip") as (_, base, _):
            async with aiohttp.ClientSession() as s:
                status, _, _ = await post(s, f"{base}/v1/completions", body, {"Authorization": "Bearer other"})
                assert status == 400
                status, _, _ = await post(s, f"{base}/v1/completions", body, {"Authorization": "Bearer vip"})
                assert status == 200
                assert [r.priority for r in client.requests.values()] == [5]
        async with serve(FakeEngineClient(), allow_client_priority=True) as (_, base, _):
            async with aiohttp.ClientSession() as s:
                assert (await post(s, f"{base}/v1/completions", body))[0] == 200
    run(main())
