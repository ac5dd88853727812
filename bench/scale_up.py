"""Elastic EP scale-up cost, KV reuse versus profiling, in one run.

    .venv/bin/python -m bench.scale_up [--model DIR] [--preset bench-moe] [--trials 2] [--load-s 20]

A real deployment (embedded etcd, HTTP frontend, EP engine processes, leader
controller; tests/elastic/_deployment.py) on the bench-moe demo model. Each trial scales 2 -> 3
(timed) and back 3 -> 2 in four ways: the new engine reusing the group's published KV
figure ("reused": no profiling, no warm-up) or profiling, each launched cold (a new
interpreter) and from a warm standby process (elastic/standby.py: imports done, waiting
for its assignment). Reported per phase, from the new engine's own timings:

- launch:  the launcher's call -> the engine code starts loading (interpreter, imports,
           etcd connection, frontend handshake);
- weights: non-expert weights and this rank's experts;
- kv init: profiling (profiled only) + allocating the KV cache;
- switch:  the commit of the group switch (re-home, build the group) on the new rank;
- total:   the scale command -> every rank of the new epoch serving; "other" is what
           the phases do not cover (leader ticks, etcd round trips, the prepare wait).

Then the throughput (output tokens/s of a steady streaming load) in steady state versus
during a scale-up, and the time to recover from SIGKILL of a rank (kill -> the re-formed
smaller group serving, -> back at full size). The issue's target is that the reused path
takes at most half of the profiled path's total.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.streaming_load import stream_completion
from tests.elastic._deployment import EPDeployment

MODES = [("reused", False), ("profiled", False), ("reused", True), ("profiled", True)]


def ensure_model(path: Path, preset: str = "bench-moe") -> str:
    if not (path / "config.json").is_file():
        from planaria.engine.demo_model import build_demo_model

        build_demo_model(path, preset=preset)
    return str(path)


def new_engine_timings(d: EPDeployment, before: set[str]) -> dict:
    recs = {r.engine_id: r for r in d.node.membership.list_engines()}
    new = [e for e in d.epoch().ranks if e not in before]
    r = recs[new[0]]
    t = dict(r.timings)
    launched = d.launcher.launch_times[new[0]]
    epoch_at = d.epoch().created_at
    return {"engine": new[0], "kv_source": r.kv_source,
            "standby": new[0] in d.launcher.launched_from_standby,
            "launch_s": t.get("load_begin_at", launched) - launched,
            "etcd_s": t.get("cluster_s", 0.0),  # part of launch
            "weights_s": t.get("weights_s", 0.0),
            "kv_init_s": t.get("profile_s", 0.0) + t.get("kv_alloc_s", 0.0),
            "switch_s": t.get("switch_s", 0.0),
            # READY in etcd -> the leader's epoch; epoch -> this rank arrived; arrived -> serving
            "leader_s": epoch_at - t.get("ready_at", epoch_at),
            "prepare_s": t.get("arrived_at", epoch_at) - epoch_at,
            "commit_wait_s": t.get("serving_at", 0.0) - t.get("arrived_at", 0.0) - t.get("switch_s", 0.0),
            "serving_at": t.get("serving_at", 0.0)}


def _wait_standby_warm(d: EPDeployment, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not d.launcher.standby_ready():
        if time.monotonic() > deadline:
            raise TimeoutError("the standby process did not warm up")
        time.sleep(0.1)


def timed_scale_up(d: EPDeployment, reuse: bool, standby: bool) -> dict:
    d.node.controller.reuse_kv = reuse
    if standby:
        d.launcher.standby(True)
        _wait_standby_warm(d)
        time.sleep(1.0)  # let the machine settle after the standby's imports
    ep = d.epoch()
    before = set(ep.ranks)
    t0 = time.time()
    d.scale(3)
    ep3, _ = d.wait_serving(3, newer_than=ep.number, timeout_s=300, poll_s=0.01)
    total = time.time() - t0
    d.launcher.standby(False)
    row = new_engine_timings(d, before)
    row["total_s"] = total
    row["to_launch_s"] = d.launcher.launch_times[row["engine"]] - t0  # command -> launcher called
    row["seen_s"] = t0 + total - row.pop("serving_at")  # the rank serves -> seen serving (op done, frontend)
    row["other_s"] = total - sum(row[k] for k in ("launch_s", "weights_s", "kv_init_s", "switch_s"))
    d.scale(2)
    d.wait_serving(2, newer_than=ep3.number, timeout_s=300)
    return row


async def _load(base: str, seconds: float, model_name: str, concurrency: int = 8) -> tuple[int, float]:
    stop = time.monotonic() + seconds
    tokens = errors = 0
    body = {"model": model_name, "prompt": "the of and a to in is you that", "max_tokens": 32,
            "ignore_eos": True, "temperature": 0.0}

    async def worker(s):
        nonlocal tokens, errors
        while time.monotonic() < stop:
            r = await stream_completion(s, base, body)
            if r["status"] == 200 and not r["error"]:
                tokens += 32
            else:
                errors += 1
    t0 = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*[worker(s) for _ in range(concurrency)])
    if errors:
        raise RuntimeError(f"{errors} request(s) failed during the load")
    return tokens, time.monotonic() - t0


def throughput(d: EPDeployment, during_scale: bool, seconds: float = 20.0) -> float:
    async def main():
        task = asyncio.create_task(_load(d.base_url, seconds, Path(d.model).resolve().name))
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".state/models/bench-moe")
    ap.add_argument("--preset", default="bench-moe", help="demo preset built at --model if missing")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--load-s", type=float, default=20.0, help="seconds of each throughput load")
    args = ap.parse_args()
    model = ensure_model(Path(args.model), args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        d = EPDeployment(Path(tmp), model, num_engines=2,
                         engine_config={"max_num_seqs": 16, "max_model_len": 1024})
        try:
            d.start(timeout_s=600)
            rows: dict[tuple[str, bool], list[dict]] = {m: [] for m in MODES}
            for _ in range(args.trials):
                for mode, standby in MODES:
                    rows[(mode, standby)].append(timed_scale_up(d, reuse=(mode == "reused"), standby=standby))
            print(f"{'mode':>9} {'launch':>8} {'kv_source':>10} {'launch s':>9} {'weights s':>10} {'kv init s':>10} "
                  f"{'switch s':>9} {'other s':>8} {'total s':>8}")
            med = {}
            for (mode, standby), rs in rows.items():
                how = "standby" if standby else "cold"
                for r in rs:
                    assert r["standby"] == standby and r["kv_source"] == mode, r
                    print(f"{mode:>9} {how:>8} {r['kv_source']:>10} {r['launch_s']:>9.2f} {r['weights_s']:>10.2f} "
                          f"{r['kv_init_s']:>10.3f} {r['switch_s']:>9.3f} {r['other_s']:>8.2f} {r['total_s']:>8.2f}")
                med[(mode, standby)] = statistics.median(r["total_s"] for r in rs)
            print("where 'other' goes (medians): " + "; ".join(
                f"{m}/{'standby' if sb else 'cold'}: etcd in launch "
                f"{statistics.median(r['etcd_s'] for r in rs):.2f}, READY->epoch "
                f"{statistics.median(r['leader_s'] for r in rs):.2f}, epoch->arrived "
                f"{statistics.median(r['prepare_s'] for r in rs):.2f}, arrived->all arrived "
                f"{statistics.median(r['commit_wait_s'] for r in rs):.2f}, command->launch "
                f"{statistics.median(r['to_launch_s'] for r in rs):.2f}, serving->seen "
                f"{statistics.median(r['seen_s'] for r in rs):.2f}" for (m, sb), rs in rows.items()))
            for standby in (False, True):
                reused, profiled = med[("reused", standby)], med[("profiled", standby)]
                ratio = reused / profiled
                print(f"median total, {'standby' if standby else 'cold'} launch: reused {reused:.2f} s, "
                      f"profiled {profiled:.2f} s, ratio reused/profiled = {ratio:.2f} "
                      f"(target <= 0.50: {'met' if ratio <= 0.5 else 'not met'})")
            steady = throughput(d, during_scale=False, seconds=args.load_s)
            during = throughput(d, during_scale=True, seconds=args.load_s)
            print(f"throughput: steady {steady:.1f} tok/s, during a scale-up {during:.1f} tok/s, "
                  f"ratio {during / steady:.2f}")
            rl = rank_loss(d)
            print(f"rank loss (SIGKILL): re-formed smaller group serving after {rl['to_reformed_s']:.2f} s, "
                  f"back at full size after {rl['to_full_size_s']:.2f} s")
        finally:
            d.close()


if __name__ == "__main__":
    main()
