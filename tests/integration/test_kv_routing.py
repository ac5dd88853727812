"""KV-aware routing for real: `planaria serve` with 2 tiny-moe engines (replica, and the
expert-parallel ranks of `make serve`'s default), its frontend, and a
second frontend (an EngineClient of this test, client index 1, which every engine also
handshakes with: --extra-client-addresses), over real HTTP and real sockets.

A conversation's turns go to the engine holding its history; another tenant's salt
matches nothing; both frontends' indexes hold the same blocks; `planaria status` and
/metrics show the routing; a SIGKILLed engine comes back with an empty index; an engine
scaled away is forgotten; nothing is ever routed to an engine known to be down."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from planaria.common.sockets import ipc_addresses
from planaria.engine.client import EngineClient
from tests.engine._engine_procs import LoopThread
from tests.integration.test_supervisor import Daemon, _stop_tree

pytestmark = pytest.mark.timeout(400)

ENGINE_CONFIG = {"kv_cache_bytes": 16 * 2**20, "max_model_len": 1024, "max_num_seqs": 16,
                 "max_num_batched_tokens": 512, "num_threads": 1}
HISTORY = [100 + i % 300 for i in range(200)]  # a conversation's first prompt (12 full blocks of 16)


def _complete(d: Daemon, prompt: list[int], **extra) -> dict:
    status, text = d.http("/v1/completions", {"model": "tiny-moe", "prompt": prompt, "max_tokens": 4,
                                              "temperature": 0.0, "ignore_eos": True, **extra})
    assert status == 200, text
    return json.loads(text)


def _routing(d: Daemon, until=lambda r: True, what: str = "routing figures") -> dict:
    """The frontend's routing as `planaria status` shows it (from the frontend's liveness
    beats, so up to a beat old), once ``until`` holds for it."""
    return _until(lambda: (lambda r: r if r and until(r) else None)(d.status()["routing"]), 30, what)


def _until(fn, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.2)


def test_kv_routing_through_the_daemon(tiny_moe, tmp_path):
    second_dir = Path(tempfile.mkdtemp(prefix="pl-kv-"))  # ipc paths stay short
    lt = LoopThread()
    second = EngineClient(2, second_dir, client_index=1)  # a second frontend: its own index
    lt.run(second.start(wait_ready=False))
    d = Daemon(tiny_moe, tmp_path, extra_args=(
        "--engine-config-json", json.dumps(ENGINE_CONFIG),
        "--extra-client-addresses", ipc_addresses(second_dir, 1)[0]))
    try:
        d.wait_all_up(2, timeout_s=180)
        prompt = HISTORY
        for turn in range(4):  # each turn extends the last one's prompt
            _complete(d, prompt)
            prompt = prompt + [400 + turn] * 40
        routing = _routing(d, lambda r: sum(r["decisions"].values()) == 4)
        assert routing["policy"] == "kv"
        assert routing["decisions"]["no_prefix"] == 1 and routing["decisions"]["prefix"] == 3, routing
        [holder] = [i for i, e in routing["engines"].items() if e["num_routed"] == 4]
        other = next(i for i in routing["engines"] if i != holder)
        assert routing["engines"][holder]["num_cached_blocks"] >= len(prompt) // 16 - 3
        assert routing["engines"][holder]["routed_hit_rate"] > 0.5

        # another tenant: the same tokens under its salt match nothing, in routing and in the engine
        _complete(d, prompt, cache_salt="tenant-b")
        assert _routing(d, lambda r: sum(r["decisions"].values()) == 5)["decisions"]["no_prefix"] == 2

        # the second frontend learnt the same blocks from the same engines' events
        def indexes_agree():
            r = d.status()["routing"]["engines"]
            return all(second.engines[int(i)].num_cached_blocks == r[i]["num_cached_blocks"] for i in r)
        _until(indexes_agree, 30, "the same index in both frontends")

        status_text = d.cli("status").stdout
        assert "CACHED" in status_text and "HIT" in status_text and "routing: kv;" in status_text, status_text
        _, metrics = d.http("/metrics")
        assert re.search(r'^planaria_routing_decisions_total\{reason="prefix"\} 3$', metrics, re.M), metrics
        assert re.search(rf'^planaria_engine_cached_blocks\{{engine="{holder}"\}} [1-9]', metrics, re.M)

        # a prefix other requests just matched (shared) on a holder past the imbalance bound:
        # the requests routed away for balance copy its blocks from the holder's segment
        # (kv_peer: a node-wide prefix cache) instead of computing them, with the same text
        hot = [HISTORY + [600 + i] * 4 for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda p: _complete(d, p, max_tokens=8), hot))
        routing = _routing(d, lambda r: sum(r["decisions"].values()) == 13)
        assert routing["decisions"]["balance"] >= 1, routing
        _, metrics = d.http("/metrics")
        copied = re.search(rf'^planaria_engine_peer_kv_blocks\{{engine="{other}"\}} (\d+)', metrics, re.M)
        assert copied and int(copied.group(1)) >= len(HISTORY) // 16, metrics
        alone = [_complete(d, p, max_tokens=8) for p in hot]
        assert [r["choices"][0]["text"] for r in together] == [r["choices"][0]["text"] for r in alone]
        decided = sum(_routing(d, lambda r: sum(r["decisions"].values()) == 21)["decisions"].values())
        prefix_before = d.status()["routing"]["decisions"]["prefix"]

        # SIGKILL the holder: the supervisor reports it, it restarts with an empty index
        victim = next(e["pid"] for e in d.status()["engines"] if str(e["engine_id"]) == holder)
        os.kill(victim, signal.SIGKILL)
        _until(lambda: any(str(e["engine_id"]) == holder and e["state"] == "running" and e["pid"] != victim
                           for e in d.status()["engines"]), 120, "the killed engine back")
        _until(lambda: second.engines[int(holder)].pid != victim and second.engines[int(holder)].healthy, 60,
               "the second frontend to see the new engine")
        _routing(d, lambda r: r["engines"][holder]["num_cached_blocks"] == 0, "the new engine's empty index")
        assert second.engines[int(holder)].num_cached_blocks == 0
        # the holder's blocks went with it: only the other engine holds the conversation's
        # start now (the hot requests copied it there), so it takes the next turn
        routed_before = d.status()["routing"]["engines"][other]["num_routed"]
        _complete(d, prompt + [9] * 20)
        routing = _routing(d, lambda r: sum(r["decisions"].values()) == decided + 1)
        assert routing["decisions"]["prefix"] == prefix_before + 1, routing
        assert routing["engines"][other]["num_routed"] == routed_before + 1, routing

        # scale away engine 1 (the highest): its index goes with its drain
        _complete(d, HISTORY + [7] * 30)
        scaled = d.cli("scale", "to", "1", "--wait", timeout_s=180)
        assert scaled.returncode == 0, scaled.stderr + scaled.stdout
        _routing(d, lambda r: r["engines"]["1"]["num_cached_blocks"] == 0 and r["engines"]["1"]["state"] != "running",
                 "engine 1's index dropped")
        for _ in range(3):
            _complete(d, HISTORY + [8] * 30)
        routing = _routing(d, lambda r: sum(r["decisions"].values()) == decided + 5)
        assert all(e["num_routed_while_down"] == 0 for e in routing["engines"].values()), routing
        assert other in routing["engines"]
    finally:
        _stop_tree(d.proc)
        shutil.rmtree(d.runtime, ignore_errors=True)
        lt.run(second.close())
        lt.close()
        shutil.rmtree(second_dir, ignore_errors=True)


def test_kv_routing_across_expert_parallel_ranks(tiny_moe, tmp_path):
    """The default `make serve` deployment: attention (and its KV) is per rank, so a
    conversation's turns go to the rank holding its history; a SIGKILLed rank is dropped
    from the index at its death report and comes back empty when the group re-forms."""
    d = Daemon(tiny_moe, tmp_path, extra_args=("--parallel", "ep", "--engine-config-json", json.dumps(ENGINE_CONFIG)))
    try:
        d.wait(lambda s: s["num_up"] == 2 and (s.get("ep") or {}).get("world_size") == 2
               and all(e["state"] == "serving" for e in s["ep"]["engines"].values()), 180, "EP group of 2")
        prompt = HISTORY
        for turn in range(3):
            _complete(d, prompt)
            prompt = prompt + [400 + turn] * 40
        routing = _routing(d, lambda r: sum(r["decisions"].values()) == 3)
        assert routing["decisions"]["no_prefix"] == 1 and routing["decisions"]["prefix"] == 2, routing
        [holder] = [i for i, e in routing["engines"].items() if e["num_routed"] == 3]
        assert routing["engines"][holder]["num_cached_blocks"] > 0

        victim = next(e["pid"] for e in d.status()["engines"] if str(e["engine_id"]) == holder)
        os.kill(victim, signal.SIGKILL)
        _routing(d, lambda r: r["engines"][holder]["num_cached_blocks"] == 0, "the dead rank's index dropped")
        _complete(d, prompt)  # served by the survivor while the rank is away (or by it, back and empty)
        d.wait(lambda s: s["num_up"] == 2 and all(e["state"] == "serving" for e in s["ep"]["engines"].values())
               and any(str(e["engine_id"]) == holder and e["pid"] != victim for e in s["engines"]),
               180, "the killed rank back in the group")
        routing = _routing(d, lambda r: sum(r["decisions"].values()) == 4)
        assert all(e["num_routed_while_down"] == 0 for e in routing["engines"].values()), routing
    finally:
        _stop_tree(d.proc)
        shutil.rmtree(d.runtime, ignore_errors=True)
