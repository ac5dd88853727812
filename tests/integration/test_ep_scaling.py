"""Elastic expert parallelism with a real etcd and real processes, under streaming load:
scale 2 -> 3 -> 2, SIGKILL of a rank, etcd killed and restarted. Every request completes
and its text equals a fault-free single-engine run."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from bench.fault_recovery import request_bodies, stream_completion
from elastic.harness import EPDeployment

pytestmark = pytest.mark.timeout(900)
NUM_STREAMS = 8


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, tiny_moe):
    d = EPDeployment(tmp_path_factory.mktemp("ep"), tiny_moe, num_engines=2)
    try:
        d.start()
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def bodies():
    return request_bodies(24, (24, 48), seed=3)


@pytest.fixture(scope="module")
def reference(tiny_moe, bodies):
    """Fault-free texts from the offline engine on the same model (single engine, no EP)."""
    from engine import LLM, SamplingParams

    llm = LLM(tiny_moe, kv_cache_bytes=32 * 2**20, max_model_len=1024)
    outs = []
    for b in bodies:
        sp = SamplingParams(temperature=b["temperature"], top_p=b.get("top_p", 1.0), seed=b.get("seed"),
                            max_tokens=b["max_tokens"], ignore_eos=True)
        outs.append(llm.generate([b["prompt"]], sp)[0].text)
    return outs


def _load(d: EPDeployment, bodies, during) -> list[dict]:
    """Stream every body (NUM_STREAMS at a time) while `during()` runs in a thread."""

    async def main():
        sem = asyncio.Semaphore(NUM_STREAMS)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            async def one(b):
                async with sem:
                    return await stream_completion(s, d.base_url, b)

            tasks = [asyncio.create_task(one(b)) for b in bodies]
            await asyncio.sleep(0.5)
            await asyncio.to_thread(during)
            return await asyncio.gather(*tasks)

    return asyncio.run(main())


def _check(results, reference):
    bad = [(i, r) for i, (r, ref) in enumerate(zip(results, reference))
           if r["status"] != 200 or r["error"] or r["text"] != ref]
    assert not bad, bad[:3]


def test_scale_up_and_down_under_load(deployment, bodies, reference):
    d = deployment
    ep0 = d.epoch()

    def scale_cycle():
        d.scale(3)
        ep, up_s = d.wait_serving(3, newer_than=ep0.number)
        records = {r.engine_id: r for r in d.node.membership.list_engines()}
        new = [e for e in ep.ranks if e not in ep0.ranks]
        assert [records[e].kv_source for e in new] == ["reused"]
        assert all(records[e].kv_source == "profiled" for e in ep0.ranks)
        d.scale(2)
        d.wait_serving(2, newer_than=ep.number)

    _check(_load(d, bodies, scale_cycle), reference)


def test_sigkill_of_a_rank_mid_load(deployment, bodies, reference):
    d = deployment
    ep0 = d.epoch()

    def kill():
        d.kill_rank(1)
        d.wait_serving(2, newer_than=ep0.number + 1, timeout_s=180)  # reform, then scale back up

    _check(_load(d, bodies, kill), reference)


def test_etcd_outage_mid_load_loses_nothing(deployment, bodies, reference):
    d = deployment
    ep0 = d.epoch()

    def outage():
        d.etcd.kill()
        time.sleep(4)
        with pytest.raises(Exception):
            d.scale(3)  # membership changes are refused while etcd is down
        d.etcd.start()

    _check(_load(d, bodies, outage), reference)
    ep, _ = d.wait_serving(2, timeout_s=60)
    assert ep.ranks == ep0.ranks  # no engine restarted for the outage
