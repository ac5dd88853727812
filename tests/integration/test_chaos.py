"""Chaos: steady streaming load through the real HTTP frontend while engines are SIGKILLed,
hung (SIGSTOP) and made to fail inside a step, at random; every request must complete with
exactly the text of a fault-free run of it.

Real processes, all of them the shipped daemon: `planaria serve` (the supervisor) with its
frontend and two engine cores on the tiny-moe demo model (bench/serve_stack.py). The
supervisor alone notices each fault: a pidfd for a SIGKILL, its heartbeat watchdog for a
SIGSTOPped engine (it must kill it), the engine's own exit after a step raised; it reports
ENGINE_CORE_DEAD to the frontend and restarts the engine. Bounded to a few minutes on two
cores.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

from bench.serve_stack import ServeStack
from bench.streaming_load import request_bodies, stream_completion

NUM_STREAMS = 8
NUM_BODIES = 24
HANG_TIMEOUT_S = 1.0
# each kind once, then both engines SIGKILLed at the same time
FAULTS = ["kill", "hang", "fatal", "both"]

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def stack(tiny_moe, tmp_path_factory):
    s = ServeStack(tmp_path_factory.mktemp("chaos"), num_engines=2, hang_timeout_s=HANG_TIMEOUT_S,
                   model=tiny_moe)
    try:
        s.start(timeout_s=120)
        yield s
    finally:
        s.close()


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


def test_streams_survive_random_engine_faults(stack):
    t_start = time.monotonic()
    bodies = request_bodies(NUM_BODIES, (32, 64), seed=7)
    rng = random.Random(11)

    async def reference() -> list[str]:
        sem = asyncio.Semaphore(NUM_STREAMS)
        async with aiohttp.ClientSession() as s:
            async def one(b):
                async with sem:
                    return await stream_completion(s, stack.base, b)
            results = await asyncio.gather(*[one(b) for b in bodies])
        for r in results:
            assert r["error"] is None and r["status"] == 200 and r["finish_reason"] == "length", r
        return [r["text"] for r in results]

    expected = asyncio.run(reference())
    replays_before = stack.metrics().get("planaria_request_replays_total", 0.0)
    stats = {"admission_503": 0, "done": 0}
    failures: list[str] = []
    faults = []  # (Fault, the supervisor's exit event)
    timings: list[float] = []

    async def chaos() -> None:
        stop = asyncio.Event()

        async def worker(w: int, session) -> None:
            k = w
            while not stop.is_set():
                i = k % NUM_BODIES
                r = await _one(session, stack.base, bodies[i], stats)
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
                await loop.run_in_executor(None, stack.wait_ready, 90.0)
                await asyncio.sleep(rng.uniform(0.3, 1.2))  # into the load
                if kind == "both":
                    done = [stack.fault(i, "kill") for i in range(stack.num_engines)]
                else:
                    done = [await loop.run_in_executor(
                        None, stack.fault, rng.randrange(stack.num_engines), kind)]
                for fault in done:  # the supervisor noticed (a hang: its watchdog killed it)
                    faults.append((fault, await loop.run_in_executor(None, stack.wait_exit, fault, 30.0)))
                timings.append(round(loop.time() - t0, 1))
            await loop.run_in_executor(None, stack.wait_ready, 90.0)
            await asyncio.sleep(1.0)  # some load on the restored daemon too
            stop.set()

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            await asyncio.wait_for(asyncio.gather(killer(), *[worker(w, session) for w in range(NUM_STREAMS)]),
                                   timeout=300)

    try:
        asyncio.run(chaos())
    except Exception:
        print(stack.logs())
        raise
    m = stack.metrics()
    replays = m.get("planaria_request_replays_total", 0.0) - replays_before
    summary = [(f.kind, f.engine_id, e["reason"]) for f, e in faults]
    print(f"chaos: {stats['done']} requests, {int(replays)} replays, {stats['admission_503']} admission 503s, "
          f"{time.monotonic() - t_start:.0f} s, seconds per fault {timings}")
    for line in summary:
        print("  fault", line)
    assert not failures, "\n".join(failures[:10]) + f"\n{len(failures)} failure(s)\n{stack.logs()}"
    assert stats["done"] >= 2 * NUM_STREAMS
    assert len(faults) == len(FAULTS) + 1  # "both" kills two
    for fault, exited in faults:  # the supervisor saw each fault for what it was
        kind = "kill" if fault.kind == "both" else fault.kind
        assert stack.exit_matches(kind, exited["reason"]), (fault, exited)
    # ... and reported each death to the frontend itself (the engine could not, but for "fatal")
    reported = {e["pid"] for e in stack.events("reported engine death to the frontend")}
    assert {f.pid for f, _ in faults} <= reported
    status = stack.status()
    assert sum(e["restarts"] for e in status["engines"]) == len(faults)
    assert status["num_deaths_reported"] >= len(faults)
    assert replays >= len(FAULTS), m  # every fault hit requests in flight
    assert m.get("planaria_replay_latency_seconds_count", 0) >= 1
    assert m.get('planaria_request_errors_total{kind="replay_limit"}', 0) == 0
