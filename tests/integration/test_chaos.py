"""Chaos: steady streaming load through the real HTTP frontend while engines are SIGKILLed,
hung (SIGSTOP) and made to fail inside a step, at random; every request must complete with
exactly the text of a fault-free run of it.

Real processes: the frontend, two engine cores on the tiny-moe demo model, and the
stand-in supervisor of bench/fault_recovery.py (``Cluster``: process sentinels that report
ENGINE_CORE_DEAD and respawn; its hang detector is "SIGKILL a SIGSTOPped engine after
``hang_timeout_s``"). Bounded to about three minutes on two cores.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

from bench.fault_recovery import Cluster, request_bodies, stream_completion

NUM_STREAMS = 8
NUM_BODIES = 24
# each kind at least once, then one with both engines down at the same time
FAULTS = ["kill", "hang", "fatal", "kill", "hang", "fatal", "both"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("chaos"), num_engines=2, hang_timeout_s=1.0)
    try:
        c.start(timeout_s=120)
        yield c
    finally:
        c.close()


async def _one(session, base: str, body: dict, stats: dict) -> dict:
    """A request as a client would send it: a 503 at admission (no engine running, before
    any token) is retried after a moment; anything after admission is the result."""
    deadline = time.monotonic() + 60
    while True:
        r = await stream_completion(session, base, body)
        if r["status"] == 503 and time.monotonic() < deadline:
            stats["admission_503"] += 1
            await asyncio.sleep(0.2)
            continue
        return r


def test_streams_survive_random_engine_faults(cluster):
    t_start = time.monotonic()
    bodies = request_bodies(NUM_BODIES, (32, 64), seed=7)
    rng = random.Random(11)

    async def reference() -> list[str]:
        sem = asyncio.Semaphore(NUM_STREAMS)
        async with aiohttp.ClientSession() as s:
            async def one(b):
                async with sem:
                    return await stream_completion(s, cluster.base, b)
            results = await asyncio.gather(*[one(b) for b in bodies])
        for r in results:
            assert r["error"] is None and r["status"] == 200 and r["finish_reason"] == "length", r
        return [r["text"] for r in results]

    expected = asyncio.run(reference())
    replays_before = cluster.metrics().get("planaria_request_replays_total", 0.0)
    stats = {"admission_503": 0, "done": 0}
    failures: list[str] = []
    faults_done: list[tuple[str, int]] = []
    timings: list[float] = []

    async def chaos() -> None:
        stop = asyncio.Event()

        async def worker(w: int, session) -> None:
            k = w
            while not stop.is_set():
                i = k % NUM_BODIES
                r = await _one(session, cluster.base, bodies[i], stats)
                stats["done"] += 1
                if r["error"] is not None or r["status"] != 200:
                    failures.append(f"body {i}: status {r['status']} error {r['error']}")
                elif r["text"] != expected[i] or r["finish_reason"] != "length":
                    failures.append(f"body {i}: {r['text']!r} != {expected[i]!r} ({r['finish_reason']})")
                k += NUM_STREAMS

        async def killer() -> None:
            loop = asyncio.get_running_loop()
            for kind in FAULTS:
                t0 = loop.time()
                await loop.run_in_executor(None, cluster.wait_ready, 90.0)
                timings.append(round(loop.time() - t0, 1))
                await asyncio.sleep(rng.uniform(0.3, 1.2))  # into the load
                num_exits = len(cluster.exits) + (cluster.num_engines if kind == "both" else 1)
                if kind == "both":
                    for i in range(cluster.num_engines):
                        cluster.fault(i, "kill")
                    faults_done.append((kind, -1))
                else:
                    index = rng.randrange(cluster.num_engines)
                    await loop.run_in_executor(None, cluster.fault, index, kind)
                    faults_done.append((kind, index))
                deadline = loop.time() + 30
                while len(cluster.exits) < num_exits:  # the fault took (a hang: once detected)
                    assert loop.time() < deadline, f"{kind}: no engine exit within 30 s"
                    await asyncio.sleep(0.05)
                timings.append(round(loop.time() - t0, 1))
            await loop.run_in_executor(None, cluster.wait_ready, 90.0)
            await asyncio.sleep(1.0)  # some load on the restored cluster too
            stop.set()

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            await asyncio.wait_for(asyncio.gather(killer(), *[worker(w, session) for w in range(NUM_STREAMS)]),
                                   timeout=150)

    try:
        asyncio.run(chaos())
    except Exception:
        print(cluster.logs())
        raise
    m = cluster.metrics()
    replays = m.get("planaria_request_replays_total", 0.0) - replays_before
    exits = [(i, code) for i, _, code in cluster.exits]
    print(f"chaos: {stats['done']} requests, {int(replays)} replays, {stats['admission_503']} admission 503s, "
          f"faults {faults_done}, engine exits {exits}, {time.monotonic() - t_start:.0f} s, timings {timings}")
    assert not failures, "\n".join(failures[:10]) + f"\n{len(failures)} failure(s)\n{cluster.logs()}"
    assert len(faults_done) == len(FAULTS) and stats["done"] >= 2 * NUM_STREAMS
    assert len(exits) == len(FAULTS) + 1  # "both" kills two
    assert sorted({code for _, code in exits}) == [-9, 1]  # SIGKILLed (kill, hang) and died (fatal)
    assert replays >= len(FAULTS), m  # every fault hit requests in flight
    assert m.get("planaria_replay_latency_seconds_count", 0) >= 1
    assert m.get('planaria_request_errors_total{kind="replay_limit"}', 0) == 0
