"""Fuzz the OpenAI HTTP API of a real frontend with a real engine (tiny-moe), at scale.

    .venv/bin/python -m bench.http_fuzz --num-requests 10000 [--engines 1] [--seed 0]

Starts ``python -m planaria.frontend.main`` and its engine-core process(es) on a free
loopback port (tests/frontend/_stack.py, a tiny-moe model built into a temporary
directory), then posts ``--num-requests`` hypothesis-drawn bodies to /v1/completions,
/v1/chat/completions and /v1/embeddings (tests/frontend/_http_fuzz.py: bodies from the
protocol structs' fields with sane or hostile values, huge integers, NaN/Infinity, deep
nesting, long strings, lone surrogates, invalid UTF-8, empty and broken JSON; max_tokens
kept small), one after another. Prints the count per status code, the number of 5xx,
of rejections without an OpenAI error reason, of error events inside 200 streams, and
of engine deaths (engine pid gone or /metrics' planaria_engine_deaths_total above 0),
with up to 20 offending examples. Exits 1 if any of those is non-zero, or /health is
not 200 at the end.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ENGINE_CONFIG = dict(kv_cache_bytes=16 * 2**20, max_model_len=256, max_num_seqs=16,
                     max_num_batched_tokens=512, num_threads=1)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def _engine_deaths(metrics: str) -> int:
    for line in metrics.splitlines():
        if line.startswith("planaria_engine_deaths_total "):
            return int(float(line.split()[1]))
    return -1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http_fuzz", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (the same seed draws the same bodies)")
    args = p.parse_args(argv)

    from hypothesis import HealthCheck, Phase, given, seed, settings

    from planaria.engine.demo_model import build_demo_model
    from tests.frontend._http_fuzz import cases, describe, problems, send
    from tests.frontend._stack import Stack

    root = Path(tempfile.mkdtemp(prefix="http-fuzz-"))
    model = build_demo_model(root / "tiny-moe", "tiny-moe")
    stack = Stack(root, model, args.engines, ENGINE_CONFIG)
    statuses: collections.Counter = collections.Counter()
    bad: list[str] = []
    num_bad = 0
    try:
        stack.wait_ready(180)
        pids = [e.pid for e in stack.engines]
        t0 = time.monotonic()

        @seed(args.seed)
        @settings(max_examples=args.num_requests, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=cases())
        def one(case):
            nonlocal num_bad
            try:
                out = send(stack.base, case)
            except OSError as exc:  # no answer at all counts as a 5xx
                statuses["no answer"] += 1
                num_bad += 1
                bad.append(f"{case.path} {case.body[:200]!r}: {exc}")
                return
            statuses[out.status] += 1
            if problems(out):
                num_bad += 1
                if len(bad) < 20:
                    bad.append(describe(out))
            done = sum(statuses.values())
            if done % 1000 == 0:
                print(f"  {done} requests, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

        one()
        elapsed = time.monotonic() - t0
        alive = [e.poll() is None for e in stack.engines]
        health, _ = _get(f"{stack.base}/health")
        _, metrics = _get(f"{stack.base}/metrics")
        deaths = max(_engine_deaths(metrics), 0) + sum(not a for a in alive)
    finally:
        code = stack.stop()
    total = sum(statuses.values())
    num_5xx = sum(n for s, n in statuses.items() if not isinstance(s, int) or s >= 500)
    print(f"http_fuzz: {total} requests in {elapsed:.0f} s ({total / elapsed:.1f}/s), engine pids {pids}")
    print("status  count")
    for status, n in sorted(statuses.items(), key=lambda kv: str(kv[0])):
        print(f"{status!s:>6}  {n}")
    print(f"5xx: {num_5xx}  bad answers: {num_bad}  engine deaths: {deaths}  /health: {health}  "
          f"frontend exit: {code}")
    for line in bad:
        print("  " + line)
    return 0 if num_5xx == 0 and num_bad == 0 and deaths == 0 and health == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
