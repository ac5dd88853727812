"""Back-to-back scale cycles of the README's default deployment under a streaming load.

    .venv/bin/python -m bench.scale_cycles [--cycles 12] [--streams 4] [--max-tokens 24,48] [--model DIR]

Starts `planaria serve` as `make serve` does (2 expert-parallel engines of smollm2-moe,
an embedded etcd, the same engine config), keeps ``--streams`` streaming completions going
all the time (``--max-tokens``), and runs ``--cycles`` times, as a user would,
`planaria scale to 3 --wait` then `planaria scale to 2 --wait`. Prints each operation's
exit code, closing line and time, and at the end the requests, those that failed, and the
longest time any stream stood still during the cycles. Goal (issue 25): every operation
succeeds within 10 s, 0 requests failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.closed_loop import ClosedLoopLoad
from bench.mttr import host, longest_stall_s, model_dir
from bench.serve_stack import REPO, free_port
from bench.streaming_load import request_bodies

MAKE_SERVE_CONFIG = {"max_model_len": 2048, "max_num_seqs": 32}  # the Makefile's serve target


def planaria(*args: str, runtime: Path, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planaria.daemon.cli", *args, "--runtime-dir", str(runtime)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s)


def wait_serving(runtime: Path, engines: int, timeout_s: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = planaria("status", "--json", runtime=runtime)
        if r.returncode == 0:
            s = json.loads(r.stdout)
            ep = s.get("ep") or {}
            if s["num_up"] == engines and ep.get("world_size") == engines and ep.get("op") is None:
                return s
        time.sleep(0.5)
    raise TimeoutError(f"{engines} engines not serving within {timeout_s} s")


def _stalls(records, t_from: float, t_to: float) -> list[tuple[float, float]]:
    """Every gap between a stream's consecutive events in the window: (seconds, when it began)."""
    out = []
    for r in records:
        events = [r.started_at, *r.result.get("chunk_times", []), r.ended_at]
        out += [(b - a, a) for a, b in zip(events, events[1:]) if b > t_from and a < t_to]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale_cycles", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=12)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-tokens", default="24,48", help="LO,HI tokens per request")
    p.add_argument("--model", help="model directory (default: the smollm2-moe preset, built into the cache)")
    p.add_argument("--preset", default="smollm2-moe")
    p.add_argument("--baseline-s", type=float, default=60.0,
                   help="first, this long of the same load with no operation: its longest stall")
    args = p.parse_args(argv)
    model = model_dir(args)
    root = Path(tempfile.mkdtemp(prefix="pl-cycles-"))
    runtime = Path(tempfile.mkdtemp(prefix="pl-cy-"))  # ipc paths stay short
    port = free_port()
    cmd = [sys.executable, "-m", "planaria.daemon.cli", "serve", "--model", str(model), "--engines", "2",
           "--http", f"127.0.0.1:{port}", "--state-dir", str(root / "state"), "--runtime-dir", str(runtime),
           "--parallel", "ep", "--engine-config-json", json.dumps(MAKE_SERVE_CONFIG)]
    print(f"scale_cycles: {' '.join(cmd[2:])}\nhost: {host()}", flush=True)
    log = open(root / "serve.log", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), start_new_session=True)
    rows, failed, marks = [], [], []
    try:
        wait_serving(runtime, 2)
        lo, hi = (int(x) for x in args.max_tokens.split(","))
        bodies = [dict(b, model=model.name) for b in request_bodies(8, (lo, hi), seed=9)]
        load = ClosedLoopLoad(f"http://127.0.0.1:{port}", bodies, num_streams=args.streams).start()
        load.wait_done(args.streams, timeout_s=300)
        t_base = time.time()
        time.sleep(args.baseline_s)
        t_start = time.time()
        base = longest_stall_s(list(load.records) + load.in_flight(), t_base, t_start)
        print(f"baseline, {args.baseline_s:g} s without operations: longest stall of a stream {base or 0:.2f} s",
              flush=True)
        for cycle in range(1, args.cycles + 1):
            for target in (3, 2):
                t0 = time.monotonic()
                r = planaria("scale", "to", str(target), "--wait", "--wait-timeout-s", "120",
                             runtime=runtime, timeout_s=180)
                took = time.monotonic() - t0
                last = (r.stdout.strip().splitlines() or [r.stderr.strip()])[-1]
                rows.append((cycle, target, r.returncode, took, last))
                marks.append((t0, cycle, target))
                print(f"cycle {cycle:2d} scale to {target}: exit {r.returncode} in {took:5.1f} s: {last}", flush=True)
        t_end = time.time()
        records = load.stop(timeout_s=300)
        failed = [rec.result for rec in records if rec.result.get("error") or rec.result.get("status") != 200]
        chunks = sum(len(rec.result.get("chunk_times", [])) for rec in records)
        stall = longest_stall_s(records, t_start, t_end)
        worst = sorted(((g, t) for g, t in _stalls(records, t_start, t_end)), reverse=True)[:5]
        print("longest stalls (s, at s into the cycles): "
              + ", ".join(f"{g:.2f} at {t - t_start:.1f}" for g, t in worst))
        print(f"\n{len(records)} requests ({chunks} streamed chunks), {len(failed)} failed"
              + (f": {failed[:3]}" if failed else "") + f"; longest stall of a stream {stall or 0:.2f} s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(runtime, ignore_errors=True)
    ok = [r for r in rows if r[2] == 0]
    worst = max((r[3] for r in rows), default=0.0)
    print(f"operations: {len(ok)}/{len(rows)} succeeded; slowest {worst:.1f} s "
          f"(scale to 3: {max((r[3] for r in rows if r[1] == 3), default=0):.1f} s, "
          f"scale to 2: {max((r[3] for r in rows if r[1] == 2), default=0):.1f} s); logs in {root}")
    return 0 if len(ok) == len(rows) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
