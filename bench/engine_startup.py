"""Engine start-up time, phase by phase, with a reused KV figure and with profiling, for one
or more source trees side by side (this checkout, and e.g. a worktree of an older commit).

    .venv/bin/python -m bench.engine_startup [--model DIR] [--trials 3] [--tree NAME=PATH ...]

Two measurements per tree, KV mode and trial, interleaved so that load on the host hits
every column alike:

- phases: a fresh interpreter in the tree runs what ``python -m planaria.engine.proc`` runs from
  start to READY, in process, with a clock between the steps: interpreter start (spawn ->
  first line), ``import planaria.engine.proc``, ``import planaria.engine.core`` (torch), ``create_engine_core``
  (split by the core's own ``init_timings``: config, weights = model build + read,
  profiling, KV allocation; "other" is the rest of the constructor), and the collection
  and freeze the engine does before READY; then the first request after it (a 128-token
  prompt, 8 tokens out) and the same again, to show what a start moved onto the first
  request (no profiling forward to warm up, memory faulted in on first touch).
- proc: ``python -m planaria.engine.proc`` itself on real sockets: spawn -> HELLO (interpreter and
  the process module's imports) -> READY (torch, the model, KV), as a frontend sees it.

"reused" is an engine given the KV figure the profiled engine arrived at (a scale-up
launch: ``kv_cache_bytes`` + ``kv_source="reused"``), "profiled" one that runs the dummy
forward. Engine config as bench/scale_up.py uses (max_num_seqs 16, max_model_len 1024).
Reported: the median (or ``--stat min``) of the trials per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / ".state" / "models" / "bench-moe"
ENGINE_CONFIG = {"max_num_seqs": 16, "max_model_len": 1024}

# Runs inside the tree under test (its engine package on sys.path), mirrors engine/proc.py.
CHILD = r"""
import json, sys, time
t_first = time.time()
spawned_at, model, extra = float(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
marks = {"interpreter_s": t_first - spawned_at}
t = time.monotonic()
import planaria.engine.proc
marks["import_proc_s"] = time.monotonic() - t; t = time.monotonic()
from planaria.engine.core import create_engine_core
from planaria.engine.config import EngineConfig
marks["import_core_s"] = time.monotonic() - t; t = time.monotonic()
core = create_engine_core(EngineConfig(model=model, **extra))
marks["create_s"] = time.monotonic() - t; t = time.monotonic()
import gc
from planaria.engine import envs
if envs.get().gc_freeze:
    gc.collect(); gc.freeze()
marks["gc_s"] = time.monotonic() - t
marks["total_s"] = time.time() - spawned_at
# After READY: the first request (what a skipped profile forward or lazily faulted memory
# would move onto), then the same again once warm.
from planaria.engine.messages import EngineCoreRequest
from planaria.engine.sampling_params import SamplingParams
for key, rid in (("first_request_s", "a"), ("second_request_s", "b")):
    t = time.monotonic()
    core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=[(7 * i + len(rid)) % 4000 + 3 for i in range(128)],
                                       sampling_params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    while core.has_unfinished_requests():
        core.step()
    marks[key] = time.monotonic() - t
marks["init"] = {k: v for k, v in core.init_timings.items()}
marks["kv_cache_bytes"] = core.kv_cache_bytes
marks["dynamo_imported"] = "torch._dynamo" in sys.modules
marks["num_modules"] = len(sys.modules)
marks["engine_file"] = planaria.engine.proc.__file__
print("STARTUP " + json.dumps(marks), flush=True)
"""


def run_phases(tree: Path, model: str, extra: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    spawned_at = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, str(spawned_at), model, json.dumps(extra)],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("STARTUP "):
            return json.loads(line[len("STARTUP "):])
    raise RuntimeError(f"{tree}: the start-up child failed:\n{out.stderr[-3000:]}")


def run_proc(tree: Path, model: str, extra: dict, tmp: Path) -> dict:
    """Spawn -> HELLO -> READY of a real engine process, as a frontend sees it."""
    import msgspec
    import zmq

    from planaria.engine.wire import FRONTEND_INPUT_TYPES, HandshakeInit, MsgType, WireDecoder, WireEncoder

    ctx = zmq.Context()
    router, pull = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    in_addr, out_addr = f"ipc://{tmp / 'in'}", f"ipc://{tmp / 'out'}"
    for sock, addr in ((router, in_addr), (pull, out_addr)):
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(addr)
    enc, dec = WireEncoder(reuse_buffer=False), WireDecoder(FRONTEND_INPUT_TYPES)
    cmd = [sys.executable, "-m", "planaria.engine.proc", "--engine-index", "0", "--input-addr", in_addr,
           "--config-json", msgspec.json.encode({"model": model, **extra}).decode()]
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def recv(what: bytes):
            while True:
                if not router.poll(300_000):
                    raise TimeoutError(f"no {what!r} from the engine")
                identity, *frames = router.recv_multipart()
                t, msg = dec.decode(frames)
                if t == what:
                    return identity, msg

        identity, _ = recv(MsgType.HELLO)
        hello_s = time.monotonic() - t0
        router.send_multipart([identity, *enc.encode(MsgType.HANDSHAKE_INIT,
                                                     HandshakeInit(addresses={"output": out_addr}))])
        _, ready = recv(MsgType.READY)
        return {"hello_s": hello_s, "ready_s": time.monotonic() - t0, "kv_source": ready.kv_source}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        router.close()
        pull.close()
        ctx.term()


ROWS = [
    ("interpreter start", lambda m: m["interpreter_s"]),
    ("import planaria.engine.proc", lambda m: m["import_proc_s"]),
    ("import planaria.engine.core (torch)", lambda m: m["import_core_s"]),
    ("config.json (transformers)", lambda m: m["init"].get("config_s")),
    ("weights (build + read)", lambda m: m["init"]["weights_s"]),
    ("  model build", lambda m: m["init"].get("build_s")),
    ("  weight read", lambda m: m["init"].get("read_s")),
    ("profiling", lambda m: m["init"].get("profile_s", 0.0)),
    ("KV allocation", lambda m: m["init"]["kv_alloc_s"]),
    ("other (core constructor)", lambda m: m["create_s"] - m["init"]["weights_s"] - m["init"].get("profile_s", 0.0)
     - m["init"]["kv_alloc_s"] - m["init"].get("config_s", 0.0)),
    ("gc collect + freeze", lambda m: m["gc_s"]),
    ("total, in process", lambda m: m["total_s"]),
    ("first request after (128 + 8 tokens)", lambda m: m["first_request_s"]),
    ("the same request again", lambda m: m["second_request_s"]),
    ("proc: spawn -> HELLO", lambda m: m["proc"]["hello_s"]),
    ("proc: spawn -> READY", lambda m: m["proc"]["ready_s"]),
]


def report(results: dict[tuple[str, str], list[dict]], stat: str = "median") -> str:
    agg = statistics.median if stat == "median" else min
    cols = list(results)
    head = f"| phase ({stat}, s) | " + " | ".join(f"{tree} {mode}" for tree, mode in cols) + " |"
    lines = [head, "| --- " * (len(cols) + 1) + "|"]
    for name, get in ROWS:
        cells = []
        for col in cols:
            vals = [v for v in (get(m) for m in results[col]) if v is not None]
            cells.append(f"{agg(vals):.3f}" if vals else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| torch._dynamo imported | " + " | ".join(
        "yes" if any(m["dynamo_imported"] for m in results[c]) else "no" for c in cols) + " |")
    lines.append("| modules loaded | " + " | ".join(str(results[c][0]["num_modules"]) for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--tree", action="append", default=[],
                   help="NAME=PATH of a source tree to measure (repeat; default: this checkout)")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="per phase over the trials (min: least disturbed by other load on the host)")
    p.add_argument("--json", help="also write the raw measurements here")
    args = p.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        from planaria.engine.demo_model import build_demo_model

        build_demo_model(Path(args.model), preset="bench-moe")
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree] or [("this", REPO)]
    # The reused figure is the one a profiling engine of this checkout arrives at.
    kv_bytes = run_phases(REPO, args.model, ENGINE_CONFIG)["kv_cache_bytes"]
    modes = {"reused": {**ENGINE_CONFIG, "kv_cache_bytes": kv_bytes, "kv_source": "reused"},
             "profiled": ENGINE_CONFIG}
    results: dict[tuple[str, str], list[dict]] = {(t, m): [] for t, _ in trees for m in modes}
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        for trial in range(args.trials):
            for name, tree in trees:
                for mode, extra in modes.items():
                    m = run_phases(tree, args.model, extra)
                    sock_dir = Path(tmp) / f"{name}-{mode}-{trial}"
                    sock_dir.mkdir()
                    m["proc"] = run_proc(tree, args.model, extra, sock_dir)
                    results[(name, mode)].append(m)
                    print(f"trial {trial} {name} {mode}: in process {m['total_s']:.2f} s, "
                          f"READY after {m['proc']['ready_s']:.2f} s", flush=True)
    print(f"\n{Path(args.model).name}, KV figure {kv_bytes} bytes, {args.trials} trials\n")
    print(report(results, args.stat))
    if args.json:
        Path(args.json).write_text(json.dumps({f"{t} {m}": v for (t, m), v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
