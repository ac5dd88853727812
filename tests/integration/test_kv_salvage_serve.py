"""KV that outlives its engine, end to end (issue 29): `planaria serve` with 2 engines of the
tiny-moe demo model in the host's default dtype (replicas, and expert-parallel ranks). Streams with long prompts run twice: a
fault-free pass, then a pass where the engine holding them is SIGKILLed mid-stream and, in a
third pass, drained with a handover (the SIGUSR2 the supervisor sends for a drain, restart
or scale-down while another engine serves: the survivor copies the bulk of each request's
KV while the engine still decodes, then the requests move). The survivor adopts the dead / drained engine's committed KV blocks from its
segment (planaria_engine_salvaged_blocks grows) instead of prefilling the whole context, and
every text equals the fault-free pass's. After `planaria serve` stops, no segment is left."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from bench.serve_stack import ENGINE_CONFIG, ServeStack
from bench.streaming_load import stream_completion

pytestmark = pytest.mark.timeout(400)
NUM_STREAMS = 4


def _bodies() -> list[dict]:
    rng = random.Random(29)
    words = "the of and a to in is you that it he was for on are as with his they at".split()
    return [{"model": "tiny-moe", "prompt": f"{i} " + " ".join(rng.choice(words) for _ in range(300)),
             "max_tokens": 600, "ignore_eos": True, "temperature": 0.0} for i in range(NUM_STREAMS)]


def _pass(stack: ServeStack, bodies: list[dict], fault=None) -> tuple[list[dict], bool]:
    """The streams, and whether ``fault`` landed: once every stream has its first tokens,
    ``fault(engine)`` runs (in a thread) on the engine with most of them running (from its
    heartbeats). Under load the client reads its chunks late, so they may all be done by
    then; the fault is not applied and the pass did not land (``_faulted_pass`` runs it again)."""
    times: list[list[float]] = [[] for _ in bodies]
    landed = []

    async def run() -> list[dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as s:
            async def chaos():
                if fault is None:
                    return
                while min(len(t) for t in times) < 2:
                    await asyncio.sleep(0.005)
                loop = asyncio.get_running_loop()
                engine = await loop.run_in_executor(None, _busiest, stack)
                if engine is not None:
                    await loop.run_in_executor(None, fault, engine)
                    landed.append(engine)

            results, _ = await asyncio.gather(
                asyncio.gather(*[stream_completion(s, stack.base, b, chunk_times=t) for b, t in zip(bodies, times)]),
                chaos())
            return results

    return asyncio.run(run()), bool(landed)


def _faulted_pass(stack: ServeStack, bodies: list[dict], fault) -> list[dict]:
    """A pass whose fault landed on an engine with streams running (at most 3 tries)."""
    for _ in range(3):
        results, landed = _pass(stack, bodies, fault)
        if landed:
            return results
        stack.wait_ready(90)
    raise AssertionError("the streams were done before the fault, 3 times")


def _assert_same_texts(first: list[dict], second: list[dict]) -> None:
    """No stream of the faulted pass failed, and each text is the fault-free pass's."""
    failed = [(i, r["status"], r["error"]) for i, r in enumerate(second) if r["error"] is not None or r["status"] != 200]
    assert not failed, failed
    differ = [i for i, (a, b) in enumerate(zip(first, second)) if a["text"] != b["text"]]
    assert not differ, f"{len(differ)} of {NUM_STREAMS} differ: {differ}"


def _salvaged_blocks(stack: ServeStack) -> dict[str, float]:
    """Per engine (since its process started: a restarted engine's count begins at 0)."""
    return {k: v for k, v in stack.metrics().items() if k.startswith("planaria_engine_salvaged_blocks")}


def _salvaged_since(stack: ServeStack, before: dict[str, float]) -> float:
    """Blocks the engines adopted since ``before``: each engine's growth (a restarted one's
    count, begun again at 0, counts only past its old value)."""
    return sum(max(0.0, v - before.get(k, 0.0)) for k, v in _salvaged_blocks(stack).items())


def _assert_kv_kept(stack: ServeStack, salvaged_before: dict[str, float], m0: dict[str, float]) -> None:
    """The faulted engine's streams went on from their KV: blocks were adopted from its
    segment, and each replay or move computed its last token or so again (the partial last
    block is adopted too), not its ~300-token context (planaria_replay_recomputed_tokens).
    How many blocks are adopted depends on what the new engine's own prefix cache already
    held of the prompts (earlier passes may have put them there): 1 at least."""
    assert _salvaged_since(stack, salvaged_before) >= 1, stack.logs()
    m1 = stack.metrics()
    key = "planaria_replay_recomputed_tokens"
    count = m1[f"{key}_count"] - m0.get(f"{key}_count", 0)
    recomputed = m1[f"{key}_sum"] - m0.get(f"{key}_sum", 0)
    assert count >= 1 and recomputed <= 16 * count, (count, recomputed)


def _busiest(stack: ServeStack) -> int | None:
    """The engine with most of the streams running, from heartbeats sent after this call
    (the last one may still count the previous pass's requests, which the prefix-aware
    routing may have placed elsewhere; an engine whose step_counter moved since is stepping,
    so its count is current). One with half the streams or more is taken at once; else the
    busiest once every engine's count is fresh, or after 0.3 s (an idle engine never steps);
    None when none has a request running then (the streams are done)."""
    seen = {e["engine_id"]: e.get("step_counter") or 0 for e in stack.status()["engines"]}
    running: dict = {}
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline + 15:
        engines = stack.status()["engines"]
        running.update({e["engine_id"]: e.get("num_running") or 0 for e in engines
                        if (e.get("step_counter") or 0) > seen.get(e["engine_id"], 0)})
        busiest = max(running, key=running.get) if running else None
        if busiest is not None and 2 * running[busiest] >= NUM_STREAMS:
            return busiest
        if busiest is not None and (len(running) == len(engines) or time.monotonic() > deadline):
            return busiest if running[busiest] else None
        time.sleep(0.005)
    return None


@pytest.fixture(scope="module", params=["replica", "ep"])
def stack(request, tiny_moe, tmp_path_factory):
    """2 engines: replicas, or expert-parallel ranks (each holds the KV of its own requests)."""
    s = ServeStack(tmp_path_factory.mktemp("salvage"), num_engines=2, hang_timeout_s=1.0,
                   engine_config=dict(ENGINE_CONFIG, max_model_len=1024, kv_cache_bytes=32 * 2**20), model=tiny_moe,
                   env={"PLANARIA_CPU_DTYPE": ""}, serve_args=("--parallel", request.param))
    try:
        s.start(timeout_s=120)
        yield s
    finally:
        s.close()


def _segment_dir(stack: ServeStack) -> Path:
    status = stack.status()
    d = (status.get("kv_segments") or {}).get("dir")
    assert d, f"status names no KV segment dir: {sorted(status)}"
    return Path(d)


def test_a_killed_engines_streams_continue_from_its_kv(stack):
    bodies = _bodies()
    first, _ = _pass(stack, bodies)
    assert all(r["error"] is None and r["status"] == 200 for r in first), first
    seg_dir = _segment_dir(stack)
    assert len([p for p in seg_dir.iterdir() if re.match(r"engine\d+-\d+\.kv$", p.name)]) == 2
    before = _salvaged_blocks(stack)
    m0 = stack.metrics()

    second = _faulted_pass(stack, bodies, lambda engine: stack.fault(engine, "kill"))
    _assert_same_texts(first, second)
    _assert_kv_kept(stack, before, m0)
    stack.wait_ready(90)


def test_a_drained_engine_hands_its_streams_over_with_their_kv(stack):
    bodies = _bodies()
    stack.wait_ready(90)
    first, _ = _pass(stack, bodies)
    before = _salvaged_blocks(stack)
    m0 = stack.metrics()
    moves_before = m0.get("planaria_request_moves_total", 0.0)
    replays_before = m0.get("planaria_request_replays_total", 0.0)

    def drain(engine):
        pid = next(e["pid"] for e in stack.status()["engines"] if e["engine_id"] == engine)
        os.kill(pid, signal.SIGUSR2)  # what the supervisor sends for a drain with survivors

    second = _faulted_pass(stack, bodies, drain)
    _assert_same_texts(first, second)
    m = stack.metrics()
    moved = m.get("planaria_request_moves_total", 0.0) - moves_before
    if "ep" in stack.serve_args:
        # an EP rank that drains leaves the epoch: its requests move, or, when the group
        # re-formed without it first, are replayed with its KV (salvage) all the same
        moved += m.get("planaria_request_replays_total", 0.0) - replays_before
    assert moved > 0, stack.logs()
    _assert_kv_kept(stack, before, m0)
    stack.wait_ready(90)


def test_the_survivor_killed_mid_handover_loses_nothing(stack):
    """The engine the requests are moving to dies while it copies their KV (SIGKILL right
    after the drain began): the moves fail over as a death (replays once an engine serves
    again), and every text is still the fault-free pass's."""
    bodies = _bodies()
    stack.wait_ready(90)
    first, _ = _pass(stack, bodies)

    def drain_then_kill_the_target(engine):
        engines = {e["engine_id"]: e["pid"] for e in stack.status()["engines"]}
        os.kill(engines[engine], signal.SIGUSR2)
        time.sleep(0.02)  # the survivors are copying (prefetch_kv) now, or about to
        for other, pid in engines.items():
            if other != engine:
                os.kill(pid, signal.SIGKILL)

    second = _faulted_pass(stack, bodies, drain_then_kill_the_target)
    _assert_same_texts(first, second)
    stack.wait_ready(90)


def test_the_draining_engine_killed_mid_handover_loses_nothing(stack):
    """The draining engine is SIGKILLed while the survivors copy its KV (right after the
    drain began): its requests fail over as a death, their replays adopt its committed KV
    from the segment it left, and every text is the fault-free pass's."""
    bodies = _bodies()
    stack.wait_ready(90)
    first, _ = _pass(stack, bodies)
    before = _salvaged_blocks(stack)
    m0 = stack.metrics()

    def drain_then_kill_it(engine):
        pid = next(e["pid"] for e in stack.status()["engines"] if e["engine_id"] == engine)
        os.kill(pid, signal.SIGUSR2)
        time.sleep(0.02)  # the survivors are copying (prefetch_kv) now, or about to
        os.kill(pid, signal.SIGKILL)

    second = _faulted_pass(stack, bodies, drain_then_kill_it)
    _assert_same_texts(first, second)
    _assert_kv_kept(stack, before, m0)
    stack.wait_ready(90)


def test_a_rolling_weight_update_hands_the_streams_over_to_the_old_weights(stack, tiny_moe):
    """`planaria load-weights DIR --engine E` (the default policy, hand_over) while E streams: once E has
    read the weights, its streams move with their KV to the other engine, still on the old
    weight version (the same checkpoint under a new version name here, so the texts can be
    compared with the fault-free pass), and E swaps without waiting for them."""
    from planaria.daemon.control import ControlClient

    bodies = _bodies()
    stack.wait_ready(90)
    first, _ = _pass(stack, bodies)
    moves_before = stack.metrics().get("planaria_request_moves_total", 0.0)
    loaded = []

    def load(engine):
        started = ControlClient(stack.runtime, timeout_s=30).call(
            "load-weights", action="load", model_dir=str(Path(tiny_moe).resolve()),
            engine_id=engine, version="rollout-2")
        loaded.append((engine, started))

    second = _faulted_pass(stack, bodies, load)
    _assert_same_texts(first, second)
    [(engine, started)] = loaded
    assert list(started["engines"]) == [str(engine)], started
    assert stack.metrics().get("planaria_request_moves_total", 0.0) > moves_before, stack.logs()
    versions: dict = {}
    deadline = time.monotonic() + 30
    while len(versions) < 2 and time.monotonic() < deadline:  # each engine's, once it answers in time
        with urllib.request.urlopen(f"{stack.base}/v1/models", timeout=10) as r:
            versions = json.loads(r.read())["data"][0]["weight_versions"]
    assert len(versions) == 2, (versions, stack.logs())
    assert versions[str(engine)] == "rollout-2" and versions[str(1 - engine)] != "rollout-2", versions


def test_no_segment_outlives_serve(tiny_moe, tmp_path_factory):
    """Stopped cleanly: the segment dir is gone. SIGKILLed with its engines: the next
    `planaria serve` on that runtime dir sweeps what they left."""
    root = tmp_path_factory.mktemp("salvage-stop")
    s = ServeStack(root, num_engines=1, engine_config=dict(ENGINE_CONFIG, kv_cache_bytes=8 * 2**20), model=tiny_moe)
    s.start(timeout_s=120)
    seg_dir = _segment_dir(s)
    engine_pid = s.status()["engines"][0]["pid"]
    os.kill(s.proc.pid, signal.SIGKILL)  # the daemon (its children get SIGKILL from PDEATHSIG)
    try:
        os.kill(engine_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    s.proc.wait(10)
    assert any(p.name.endswith(".kv") for p in seg_dir.iterdir())
    runtime, s.runtime = s.runtime, Path(tempfile.mkdtemp())  # close() removes the runtime dir
    s.close()
    s2 = ServeStack(root, num_engines=1, engine_config=dict(ENGINE_CONFIG, kv_cache_bytes=8 * 2**20), model=tiny_moe)
    s2.runtime = runtime  # the same runtime dir: the same segment dir
    try:
        s2.start(timeout_s=120)
        left = sorted(p.name for p in _segment_dir(s2).iterdir())
        assert left == [f"engine0-{s2.status()['engines'][0]['pid']}.kv", "owner"], left
    finally:
        s2.close()
    assert not seg_dir.exists() or not any(seg_dir.iterdir())
