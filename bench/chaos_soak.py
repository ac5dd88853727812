"""Availability under a fault storm: `planaria serve` with its default restart policy,
steady streaming load, and a random SIGKILL (70%) or SIGSTOP (30%) of a serving engine
every 2-5 s, in replica mode and in EP mode, against a fault-free pass of the same load.

    .venv/bin/python -m bench.chaos_soak [--modes replica ep] [--duration-s 300]
        [--baseline-s 60] [--streams 8] [--seed 0]

Per mode it prints: faults made, requests completed and failed, streams whose text
differs from the fault-free pass, the share of the storm with at least one engine
serving (the supervisor's status sampled every 0.25 s), and goodput (tokens/s of
requests that completed with the right text) against the fault-free pass. Real
processes: the shipped daemon, its frontend, engines (tiny-moe) and, in EP mode, its
embedded etcd and warm standby (bench/serve_stack.py). The restart policy is the
default one (backoff 1 s doubling to 60 s, flap hold 300 s after 5 exits in 60 s,
served deaths restarted after 0.1 s); the hang limit is 3 s so that a SIGSTOPped engine
is found within seconds (the default 30 s would only slow the storm's recovery down).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.serve_stack import ServeStack
from bench.streaming_load import request_bodies, stream_completion

# ServeStack's own restart flags (restart at once, never hold) are for tests of single
# faults; the soak puts the daemon's defaults back (later flags win).
DEFAULT_POLICY = ("--restart-backoff-s", "1", "--restart-backoff-max-s", "60", "--stable-s", "10",
                  "--flap-window-s", "60", "--flap-max-exits", "5", "--flap-hold-s", "300")
HANG_TIMEOUT_S = 3.0


@dataclass
class LoadStats:
    done: int = 0
    failed: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    good_tokens: int = 0


@dataclass
class SoakResult:
    mode: str
    faults: list[tuple[float, str, int]]
    baseline: LoadStats
    baseline_s: float
    storm: LoadStats
    storm_s: float
    serving_share: float
    zero_serving_s: float
    restarts: int

    def goodput(self, stats: LoadStats, seconds: float) -> float:
        return stats.good_tokens / seconds if seconds > 0 else 0.0


async def _load(stack: ServeStack, bodies: list[dict], num_streams: int, stop: asyncio.Event,
                stats: LoadStats, reference: dict[int, str], record: bool) -> None:
    """Closed-loop streams over ``bodies`` until ``stop``; a request's result counts (done,
    failed or mismatched) whenever it ends. ``record``: the fault-free pass, whose texts
    go into ``reference``; else texts are compared with it."""
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def stream(w: int) -> None:
            k = w
            while not stop.is_set():
                i = k % len(bodies)
                k += num_streams
                try:
                    r = await stream_completion(session, stack.base, bodies[i])
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    r = {"status": 0, "error": f"{type(exc).__name__}: {exc}", "text": "", "finish_reason": None}
                stats.done += 1
                if r["status"] != 200 or r["error"] is not None:
                    stats.failed.append(f"body {i}: status {r['status']}: {str(r['error'])[:300]}")
                elif record:
                    reference.setdefault(i, r["text"])
                    stats.good_tokens += bodies[i]["max_tokens"]
                elif i in reference and r["text"] != reference[i]:
                    stats.mismatched.append(f"body {i}: {r['text']!r} != {reference[i]!r}")
                else:
                    stats.good_tokens += bodies[i]["max_tokens"]
        await asyncio.gather(*[stream(w) for w in range(num_streams)])


async def _sample(stack: ServeStack, stop: asyncio.Event, samples: list[tuple[float, bool]]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        try:
            status = await loop.run_in_executor(None, stack.status, 5.0)
            up = any(e["state"] == "running" for e in status["engines"])
        except Exception:  # noqa: BLE001 - a status that does not answer counts as down
            up = False
        samples.append((time.monotonic(), up))
        await asyncio.sleep(0.25)


async def _storm(stack: ServeStack, stop: asyncio.Event, rng: random.Random,
                 faults: list[tuple[float, str, int]], every: tuple[float, float], kill_share: float) -> None:
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(*every))
            return
        except asyncio.TimeoutError:
            pass
        status = await loop.run_in_executor(None, stack.status, 5.0)
        serving = [e for e in status["engines"] if e["state"] == "running" and e.get("pid")]
        if not serving:
            faults.append((round(time.monotonic() - t0, 1), "none serving", -1))
            continue
        victim = rng.choice(serving)
        kind = "kill" if rng.random() < kill_share else "stop"
        try:
            os.kill(victim["pid"], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        except ProcessLookupError:
            continue
        faults.append((round(time.monotonic() - t0, 1), kind, victim["engine_id"]))


def run_mode(mode: str, root: Path, args: argparse.Namespace) -> SoakResult:
    extra = DEFAULT_POLICY + (("--parallel", "ep") if mode == "ep" else ())
    (root / mode).mkdir(parents=True, exist_ok=True)
    stack = ServeStack(root / mode, num_engines=2, hang_timeout_s=HANG_TIMEOUT_S, serve_args=extra,
                       model=args.model)
    bodies = request_bodies(args.num_bodies, (24, 48), seed=args.seed)
    reference: dict[int, str] = {}
    try:
        stack.start(timeout_s=240)

        async def phase(seconds: float, storm: bool):
            stop = asyncio.Event()
            stats, samples, faults = LoadStats(), [], []
            tasks = [asyncio.create_task(_load(stack, bodies, args.streams, stop, stats, reference,
                                                 record=not storm))]
            if storm:
                rng = random.Random(args.seed)
                tasks += [asyncio.create_task(_sample(stack, stop, samples)),
                          asyncio.create_task(_storm(stack, stop, rng, faults, (2.0, 5.0), 0.7))]
            t0 = time.monotonic()
            await asyncio.sleep(seconds)
            stop.set()
            await asyncio.gather(*tasks)  # the requests in flight finish (their time counts)
            return stats, samples, faults, time.monotonic() - t0

        baseline, _, _, baseline_s = asyncio.run(phase(args.baseline_s, storm=False))
        print(f"[{mode}] fault-free pass: {baseline.done} requests in {baseline_s:.0f} s", flush=True)
        missing = [i for i in range(len(bodies)) if i not in reference]
        if missing:
            raise RuntimeError(f"the fault-free pass did not complete bodies {missing}: lengthen --baseline-s")
        storm, samples, faults, storm_s = asyncio.run(phase(args.duration_s, storm=True))
        up = [u for _, u in samples]
        zero_s = sum(0.25 for u in up if not u)
        restarts = sum(e["restarts"] for e in stack.status()["engines"])
        return SoakResult(mode, faults, baseline, baseline_s, storm, storm_s,
                          sum(up) / len(up) if up else 0.0, zero_s, restarts)
    except Exception:
        print(stack.logs(6000), file=sys.stderr)
        raise
    finally:
        stack.close()


def report(r: SoakResult) -> list[str]:
    kinds = [k for _, k, _ in r.faults]
    gp_base, gp_storm = r.goodput(r.baseline, r.baseline_s), r.goodput(r.storm, r.storm_s)
    lines = [
        f"mode {r.mode}: {len(kinds)} faults in {r.storm_s:.0f} s ({kinds.count('kill')} SIGKILL, "
        f"{kinds.count('stop')} SIGSTOP, {kinds.count('none serving')} times no engine to fault), "
        f"{r.restarts} engine restarts",
        f"  requests: {r.storm.done} completed or failed, failed {len(r.storm.failed)}, "
        f"text differs from the fault-free pass {len(r.storm.mismatched)}",
        f"  at least one engine serving: {100 * r.serving_share:.1f}% of the storm "
        f"(none serving for about {r.zero_serving_s:.1f} s)",
        f"  goodput: {gp_storm:.1f} tok/s vs {gp_base:.1f} tok/s fault-free = "
        f"{gp_storm / gp_base if gp_base else 0:.2f}x",
    ]
    lines += [f"  failed: {f}" for f in r.storm.failed[:5]] + [f"  differs: {m}" for m in r.storm.mismatched[:5]]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", choices=("replica", "ep"), default=["replica", "ep"])
    p.add_argument("--duration-s", type=float, default=300.0, help="the storm (default 300)")
    p.add_argument("--baseline-s", type=float, default=60.0, help="the fault-free pass (default 60)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--num-bodies", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="default: tiny-moe, built in the work dir")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    results = [run_mode(mode, root, args) for mode in args.modes]
    print(f"\nchaos soak: SIGKILL 70% / SIGSTOP 30% of a serving engine every 2-5 s, "
          f"{args.streams} streams, default restart policy, hang limit {HANG_TIMEOUT_S:g} s")
    for r in results:
        print("\n".join(report(r)))
    bad = any(r.storm.failed or r.storm.mismatched for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
