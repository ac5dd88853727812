"""Overload: open-loop load at 3x the measured capacity against a real `planaria serve`.

    .venv/bin/python -m bench.overload [--model bench-moe] [--factor 3] [--duration-s 60]
        [--max-tokens 32] [--max-num-seqs 16] [--serve-arg=--max-inflight-requests=24 ...]

1. Capacity: a closed loop of ``--max-num-seqs`` concurrent streams for ``--capacity-s``
   seconds; capacity = completed requests per second (the best the server does with every
   batch slot busy).
2. Overload: Poisson arrivals at ``--factor`` x capacity for ``--duration-s`` seconds, each
   request its own stream (open loop: arrivals do not wait for answers). Requests over the
   server's admission bounds get 429 with Retry-After; the client does not retry.
3. Checks, printed with their figures, exit status 1 when one fails:
   - 0 responses with a 5xx status, 0 transport errors, 0 streams ending in an error event;
   - 0 engine deaths (the engines' pids and restart counts in `planaria status` before and
     after, and the frontend's engine-death counter);
   - goodput (completed requests per second in the steady state: from 10 s into the
     overload, when the queue is full, to its end) >= 90% of capacity (the whole
     window's figure, ramp-up included, is printed too);
   - admitted requests' p99 TTFT <= the bound stated from the configuration: the
     requests admitted beyond the batch slots wait at most (inflight bound - slots) /
     capacity seconds, plus one batch's prefill; the bound printed is 2x that figure
     (plus a second) for scheduling noise on a shared host;
   - memory flat: the daemon's process tree RSS in the last 10 s of the overload is within
     10% (or 64 MiB) of its first 10 s (per process figures printed too). The KV cache is
     128 MiB by default: the engine's pages are touched on first use, so a larger cache
     keeps growing RSS until every block has been used once, bounded by its size.

The daemon is the shipped one (bench/serve_stack.py: supervisor, frontend, 1 engine),
with the frontend's in-flight bound and the engine's waiting-queue bound at their
defaults unless ``--serve-arg`` / ``--engine-config-json`` say otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import psutil

from bench.offline_vs_vllm import cpu_line, ensure_model
from bench.serve_stack import ServeStack

WORDS = ("the of and a to in is you that it he was for on are as with his they at be this "
         "have from or one had by word but not what all were we when your can said there").split()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round((len(v) - 1) * q)))]


def make_body(rng: random.Random, model: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": " ".join(rng.choice(WORDS) for _ in range(48)),
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True}


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    first = None
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                text = await r.text()
                return {"status": r.status, "t0": t0, "end": time.perf_counter(),
                        "retry_after": r.headers.get("Retry-After"), "body": text[:300]}
            error = None
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    error = obj["error"]
                elif first is None and any(c.get("text") for c in obj.get("choices", [])):
                    first = time.perf_counter()
            return {"status": 200, "t0": t0, "first": first, "end": time.perf_counter(), "error": error}
    except Exception as exc:  # noqa: BLE001 - counted as a transport error
        return {"status": None, "t0": t0, "end": time.perf_counter(), "error": f"{type(exc).__name__}: {exc}"}


async def closed_loop(base: str, model: str, streams: int, seconds: float, max_tokens: int) -> list[dict]:
    rng = random.Random(1)
    out: list[dict] = []
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def worker():
            while time.perf_counter() < deadline:
                out.append(await one(s, base + "/v1/completions", make_body(rng, model, max_tokens)))
        await asyncio.gather(*(worker() for _ in range(streams)))
    return out


async def open_loop(base: str, model: str, rate: float, seconds: float, max_tokens: int) -> list[dict]:
    rng = random.Random(2)
    tasks: list[asyncio.Task] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        t_end = time.perf_counter() + seconds
        next_t = time.perf_counter()
        while next_t < t_end:
            delay = next_t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(s, base + "/v1/completions", make_body(rng, model, max_tokens))))
            next_t += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


class RssSampler(threading.Thread):
    def __init__(self, pid: int, period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, int]] = []
        self.by_role: dict[str, list[int]] = {}  # process role -> its RSS samples
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                root = psutil.Process(self.pid)
                total = 0
                for p in [root, *root.children(recursive=True)]:
                    try:
                        rss = p.memory_info().rss
                        role = next((a.rsplit(".", 1)[-1] for a in p.cmdline() if a.startswith("planaria.")),
                                    p.name())
                    except psutil.Error:
                        continue
                    total += rss
                    self.by_role.setdefault(role, []).append(rss)
                self.samples.append((time.perf_counter(), total))
            except psutil.Error:
                pass
            self._halt.wait(self.period_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def engine_view(stack: ServeStack) -> dict:
    st = stack.status()
    return {e["engine_id"]: (e["pid"], e["restarts"], e["state"]) for e in st["engines"]}


def deaths_metric(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if "engine_death" in k or "engine_core_dead" in k)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-moe")
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--capacity-s", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--inflight-bound", type=int, default=None,
                   help="the frontend's in-flight bound the server runs with, for the TTFT bound "
                        "(default: read from /metrics, else 2 x max-num-seqs)")
    p.add_argument("--engine-config-json", default=None)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `planaria serve` flag")
    args = p.parse_args(argv)

    model = ensure_model(args.model).resolve()
    engine_config = json.loads(args.engine_config_json) if args.engine_config_json else dict(
        max_num_seqs=args.max_num_seqs, max_model_len=512, kv_cache_bytes=128 * 2**20)
    print(f"cpu: {cpu_line()}; model {model.name}; prompt 48 words, max_tokens {args.max_tokens}; "
          f"engine config {engine_config}; serve args {args.serve_arg}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="pl-overload-"))
    stack = ServeStack(root, num_engines=1, hang_timeout_s=30.0, engine_config=engine_config,
                       model=str(model), serve_args=tuple(args.serve_arg))
    failures: list[str] = []
    try:
        stack.start(timeout_s=300)
        before = engine_view(stack)
        deaths_before = deaths_metric(stack.metrics())
        asyncio.run(closed_loop(stack.base, model.name, 2, 5, 8))  # warm-up
        cap = asyncio.run(closed_loop(stack.base, model.name, engine_config.get("max_num_seqs", 16),
                                      args.capacity_s, args.max_tokens))
        ok = [r for r in cap if r["status"] == 200 and not r.get("error")]
        span = max(r["end"] for r in cap) - min(r["t0"] for r in cap)
        capacity = len(ok) / span
        cap_ttft = _pct([r["first"] - r["t0"] for r in ok if r.get("first")], 0.5)
        print(f"capacity: {len(ok)}/{len(cap)} requests in {span:.1f} s = {capacity:.2f} req/s "
              f"({capacity * args.max_tokens:.0f} output tok/s); closed-loop TTFT p50 {cap_ttft * 1e3:.0f} ms",
              flush=True)

        rate = args.factor * capacity
        sampler = RssSampler(stack.proc.pid)
        sampler.start()
        t0 = time.perf_counter()
        res = asyncio.run(open_loop(stack.base, model.name, rate, args.duration_s, args.max_tokens))
        wall = time.perf_counter() - t0
        sampler.stop()
        after = engine_view(stack)
        metrics = stack.metrics()
        deaths_after = deaths_metric(metrics)

        by_status: dict[str, int] = {}
        for r in res:
            by_status[str(r["status"])] = by_status.get(str(r["status"]), 0) + 1
        fivexx = [r for r in res if r["status"] is not None and r["status"] >= 500]
        transport = [r for r in res if r["status"] is None]
        stream_errors = [r for r in res if r["status"] == 200 and r.get("error")]
        done = [r for r in res if r["status"] == 200 and not r.get("error")]
        # steady state: completions after the first 10 s (the queue is full by then) up to
        # the end of the offered load, per second
        steady_from = min(10.0, args.duration_s / 2)
        in_window = [r for r in done if steady_from < r["end"] - t0 <= args.duration_s]
        goodput = len(in_window) / (args.duration_s - steady_from)
        whole = len([r for r in done if r["end"] - t0 <= args.duration_s]) / args.duration_s
        rejected = [r for r in res if r["status"] == 429]
        no_retry_after = [r for r in rejected if not r.get("retry_after")]
        ttfts = [r["first"] - r["t0"] for r in done if r.get("first")]
        slots = engine_config.get("max_num_seqs", 16)
        bound_inflight = args.inflight_bound
        if bound_inflight is None:
            bound_inflight = int(next((v for k, v in metrics.items() if k == "planaria_http_max_requests_in_flight"),
                                      2 * slots))
        ttft_bound = 2 * (max(bound_inflight - slots, 0) / capacity + cap_ttft) + 1.0
        rss = sampler.samples
        first10 = [b for t, b in rss if t - rss[0][0] <= 10] if rss else []
        last10 = [b for t, b in rss if rss[-1][0] - t <= 10] if rss else []
        rss_a = sum(first10) / max(len(first10), 1)
        rss_b = sum(last10) / max(len(last10), 1)
        print(f"overload: {len(res)} requests offered at {rate:.2f} req/s ({args.factor:g}x capacity) "
              f"over {args.duration_s:g} s (all answered after {wall:.1f} s); statuses {by_status}")
        print(f"  completed {len(done)}; goodput (steady state, {steady_from:g}-{args.duration_s:g} s) "
              f"{goodput:.2f} req/s = {goodput / capacity:.0%} of capacity; over the whole window "
              f"{whole:.2f} req/s = {whole / capacity:.0%}")
        print(f"  admitted TTFT p50 {_pct(ttfts, 0.5) * 1e3:.0f} ms, p99 {_pct(ttfts, 0.99) * 1e3:.0f} ms, "
              f"max {max(ttfts, default=float('nan')) * 1e3:.0f} ms; bound {ttft_bound * 1e3:.0f} ms "
              f"(in-flight bound {bound_inflight}, {slots} batch slots)")
        print(f"  429s {len(rejected)} (without Retry-After: {len(no_retry_after)}); "
              f"sample 429 body: {rejected[0]['body'][:160] if rejected else '-'}")
        print(f"  5xx {len(fivexx)}; transport errors {len(transport)}; streams ending in error {len(stream_errors)}")
        print(f"  engines before {before} after {after}; engine-death counter {deaths_before:g} -> {deaths_after:g}")
        print(f"  daemon tree RSS first 10 s {rss_a / 2**20:.0f} MiB, last 10 s {rss_b / 2**20:.0f} MiB, "
              f"peak {max((b for _, b in rss), default=0) / 2**20:.0f} MiB")
        print("  RSS by process (first sample -> last, MiB): " + ", ".join(
            f"{role} {v[0] / 2**20:.0f} -> {v[-1] / 2**20:.0f}" for role, v in sorted(sampler.by_role.items())))
        if fivexx:
            failures.append(f"{len(fivexx)} 5xx, e.g. {fivexx[0].get('body')}")
        if transport:
            failures.append(f"{len(transport)} transport errors, e.g. {transport[0]['error']}")
        if stream_errors:
            failures.append(f"{len(stream_errors)} streams ended in an error, e.g. {stream_errors[0]['error']}")
        if no_retry_after:
            failures.append(f"{len(no_retry_after)} 429s without Retry-After")
        if before != after or deaths_after != deaths_before:
            failures.append("an engine died")
        if goodput < 0.9 * capacity:
            failures.append(f"goodput {goodput:.2f} < 90% of capacity {capacity:.2f}")
        if _pct(ttfts, 0.99) > ttft_bound:
            failures.append(f"p99 TTFT {_pct(ttfts, 0.99):.2f} s over the bound {ttft_bound:.2f} s")
        if rss_b > max(rss_a * 1.10, rss_a + 64 * 2**20):
            failures.append(f"memory grew: {rss_a / 2**20:.0f} -> {rss_b / 2**20:.0f} MiB")
    finally:
        stack.close()
    print("RESULT: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
