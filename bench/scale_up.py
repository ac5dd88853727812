"""Elastic EP scale-up cost, KV reuse versus profiling, in one run.

    .venv/bin/python -m bench.scale_up [--model DIR] [--trials 2]

A real deployment (embedded etcd, HTTP frontend, EP engine processes, leader
controller; elastic/harness.py) on the bench-moe demo model. Each trial scales 2 -> 3
(timed) and back 3 -> 2, once with the new engine reusing the group's published KV
figure ("reused": no profiling, no warm-up) and once with it profiling. Reported per
phase, from the new engine's own timings: launch (process start to engine code), weight
load, KV init (profile + allocation), group switch, and the total from the scale command
to the new rank serving. Then the throughput (output tokens/s of a steady streaming load)
in steady state versus during a scale-up, and the time to recover from SIGKILL of a rank
(kill -> the re-formed smaller group serving, -> back at full size).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.fault_recovery import stream_completion
from elastic.harness import EPDeployment


def ensure_model(path: Path) -> str:
    if not (path / "config.json").is_file():
        from engine.demo_model import build_demo_model

        build_demo_model(path, preset="bench-moe")
    return str(path)


def new_engine_timings(d: EPDeployment, before: set[str]) -> dict:
    recs = {r.engine_id: r for r in d.node.membership.list_engines()}
    new = [e for e in d.epoch().ranks if e not in before]
    r = recs[new[0]]
    t = dict(r.timings)
    launched = d.launcher.launch_times[new[0]]
    return {"engine": new[0], "kv_source": r.kv_source,
            "launch_s": t.get("started_at", launched) - launched + (t.get("load_begin_at", 0) - t.get("started_at", 0)),
            "weights_s": t.get("weights_s", 0.0),
            "kv_init_s": t.get("profile_s", 0.0) + t.get("kv_alloc_s", 0.0),
            "switch_s": t.get("switch_s", 0.0)}


def timed_scale_up(d: EPDeployment, reuse: bool) -> dict:
    d.node.controller.reuse_kv = reuse
    ep = d.epoch()
    before = set(ep.ranks)
    t0 = time.time()
    d.scale(3)
    ep3, _ = d.wait_serving(3, newer_than=ep.number, timeout_s=300)
    total = time.time() - t0
    row = new_engine_timings(d, before)
    row["total_s"] = total
    d.scale(2)
    d.wait_serving(2, newer_than=ep3.number, timeout_s=300)
    return row


async def _load(base: str, seconds: float, concurrency: int = 8) -> tuple[int, float]:
    stop = time.monotonic() + seconds
    tokens = 0
    body = {"model": "bench-moe", "prompt": "the of and a to in is you that", "max_tokens": 32,
            "ignore_eos": True, "temperature": 0.0}

    async def worker(s):
        nonlocal tokens
        while time.monotonic() < stop:
            r = await stream_completion(s, base, body)
            if r["status"] == 200 and not r["error"]:
                tokens += 32
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*[worker(s) for _ in range(concurrency)])
    return tokens, time.monotonic() - t0


def throughput(d: EPDeployment, during_scale: bool) -> float:
    async def main():
        task = asyncio.create_task(_load(d.base_url, 20.0))
        if during_scale:
            await asyncio.sleep(1.0)
            ep = d.epoch()
            d.node.controller.reuse_kv = True
            d.scale(3)
            await asyncio.to_thread(d.wait_serving, 3, 300, ep.number)
        tokens, dt = await task
        return tokens / dt
    tps = asyncio.run(main())
    if during_scale:
        ep = d.epoch()
        d.scale(2)
        d.wait_serving(2, newer_than=ep.number, timeout_s=300)
    return tps


def rank_loss(d: EPDeployment) -> dict:
    ep = d.epoch()
    t0 = time.time()
    d.kill_rank(1)
    ep_small, _ = d.wait_serving(1, newer_than=ep.number, timeout_s=120)
    t1 = time.time()
    d.wait_serving(2, newer_than=ep_small.number, timeout_s=300)
    return {"to_reformed_s": t1 - t0, "to_full_size_s": time.time() - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".state/models/bench-moe")
    ap.add_argument("--trials", type=int, default=2)
    args = ap.parse_args()
    model = ensure_model(Path(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        d = EPDeployment(Path(tmp), model, num_engines=2,
                         engine_config={"max_num_seqs": 16, "max_model_len": 1024})
        try:
            d.start(timeout_s=600)
            rows = {"reused": [], "profiled": []}
            for _ in range(args.trials):
                for mode in ("reused", "profiled"):
                    rows[mode].append(timed_scale_up(d, reuse=(mode == "reused")))
            print(f"{'mode':>9} {'kv_source':>10} {'launch s':>9} {'weights s':>10} {'kv init s':>10} "
                  f"{'switch s':>9} {'total s':>8}")
            med = {}
            for mode, rs in rows.items():
                for r in rs:
                    print(f"{mode:>9} {r['kv_source']:>10} {r['launch_s']:>9.2f} {r['weights_s']:>10.2f} "
                          f"{r['kv_init_s']:>10.3f} {r['switch_s']:>9.3f} {r['total_s']:>8.2f}")
                med[mode] = statistics.median(r["total_s"] for r in rs)
            print(f"median total: reused {med['reused']:.2f} s, profiled {med['profiled']:.2f} s, "
                  f"ratio reused/profiled = {med['reused'] / med['profiled']:.2f}")
            steady = throughput(d, during_scale=False)
            during = throughput(d, during_scale=True)
            print(f"throughput: steady {steady:.1f} tok/s, during a scale-up {during:.1f} tok/s, "
                  f"ratio {during / steady:.2f}")
            rl = rank_loss(d)
            print(f"rank loss (SIGKILL): re-formed smaller group serving after {rl['to_reformed_s']:.2f} s, "
                  f"back at full size after {rl['to_full_size_s']:.2f} s")
        finally:
            d.close()


if __name__ == "__main__":
    main()
