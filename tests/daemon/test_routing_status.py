"""`planaria status` shows the frontend's routing (docs/routing.md): the figures ride on the
frontend's liveness beats (common/liveness.py), the supervisor keeps the current frontend's
latest (daemon/frontend_watch.py), and the text view shows CACHED and HIT per engine."""

from __future__ import annotations

import msgspec
import pytest

from planaria.common.liveness import MAX_ROUTED_ENGINES, Beat, EngineRouting, RoutingSummary, decode, encode
from planaria.daemon.commands import status
from planaria.daemon.frontend_watch import FrontendWatch

SUMMARY = RoutingSummary(policy="kv", decisions={"prefix": 7, "no_prefix": 2, "balance": 0}, engines=[
    EngineRouting(0, "running", 120, 6, 6000, 4500, 0), EngineRouting(1, "dead", 0, 3, 900, 0, 0)])


def test_a_beat_carries_the_routing_and_a_hostile_one_is_refused():
    assert decode(encode(Beat(pid=1, seq=2, routing=SUMMARY))).routing == SUMMARY
    assert decode(encode(Beat(pid=1, seq=2))).routing is None  # a frontend without a router
    huge = RoutingSummary(policy="kv", engines=[EngineRouting(i, "running", 0, 0, 0, 0, 0)
                                                for i in range(MAX_ROUTED_ENGINES + 1)])
    with pytest.raises(msgspec.DecodeError):
        decode(encode(Beat(pid=1, seq=2, routing=huge)))


def test_the_watch_keeps_the_current_frontends_latest_routing_only():
    watch = FrontendWatch(hang_timeout_s=10.0, start_timeout_s=60.0)
    watch.start(pid=10, now=0.0)
    assert watch.routing() is None
    watch.answered(10, 1.0, routing=SUMMARY)
    watch.answered(10, 1.5)  # a beat without figures keeps the last ones
    r = watch.routing()
    assert r["policy"] == "kv" and r["decisions"]["prefix"] == 7
    assert r["engines"]["0"] == {"state": "running", "num_cached_blocks": 120, "num_routed": 6,
                                 "routed_prompt_tokens": 6000, "routed_cached_tokens": 4500,
                                 "routed_hit_rate": 0.75, "num_routed_while_down": 0}
    assert not watch.answered(99, 2.0, routing=RoutingSummary(policy="least-loaded"))  # another process
    assert watch.routing()["policy"] == "kv"
    watch.start(pid=11, now=3.0)  # a restarted frontend starts with nothing
    assert watch.routing() is None


def _data(routing):
    engine = {"engine_id": 0, "rank": 0, "state": "running", "pid": 5, "uptime_s": 3.0, "restarts": 0,
              "num_running": 1, "num_waiting": 0, "kv_usage": 0.5, "kv_cache_bytes": 2**20, "kv_source": "given",
              "reason": ""}
    return {"status": "planaria: 1/1 engines up", "http": "127.0.0.1:8000", "ep": None, "engines": [engine],
            "frontend": {"state": "running", "pid": 4, "uptime_s": 3.0, "restarts": 0}, "routing": routing}


def test_status_text_shows_cached_blocks_hit_rate_and_decisions():
    lines = status.render(_data(SUMMARY.to_status())).splitlines()
    assert "routing: kv; requests routed by no_prefix 2, prefix 7" in lines
    header = next(line for line in lines if line.startswith("ENGINE"))
    assert header.split()[-3:] == ["CACHED", "HIT", "DTYPE"]
    assert lines[-1].split()[-3:] == ["120", "75%", "-"]


def test_status_text_without_routing_figures_has_no_routing_columns():
    text = status.render(_data(None))
    assert "CACHED" not in text and "routing:" not in text


def test_the_frontends_beats_carry_its_routers_figures_and_survive_a_failure(tmp_path):
    """frontend/liveness.py over a real ipc socket: each beat carries routing_summary of a
    real EngineClient; a routing callable that raises costs the figures, never the beat."""
    import asyncio

    import zmq

    from planaria.engine.client import EngineClient
    from planaria.frontend import liveness

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/sv-fe"
    pull.bind(address)
    client = EngineClient(2, tmp_path)

    def broken():
        raise RuntimeError("boom")

    async def main():
        tasks = liveness.start(address, 0.02, environ={}, routing=lambda: liveness.routing_summary(client))
        tasks += liveness.start(address, 0.02, environ={}, routing=broken)
        await asyncio.sleep(0.4)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(main())
        beats = []
        while pull.poll(0):
            beats.append(decode(pull.recv()))
    finally:
        pull.close(linger=0)
        ctx.term()
    with_figures = [b for b in beats if b.routing is not None]
    assert with_figures and with_figures[-1].routing.policy == "kv"
    assert len(beats) - len(with_figures) >= 3  # the broken one's beats went on, without figures
