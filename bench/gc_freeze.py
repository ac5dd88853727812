"""Step-time percentiles with and without ``gc.freeze()`` after engine start-up.

    python -m bench.gc_freeze [--preset tiny-moe] [--requests 2048] [--max-tokens 32]
                              [--repeats 3] [--warmup-steps 5] [--json OUT]

Each mode runs in a fresh child process (the freeze cannot be undone cleanly in one
process): build the EngineCore as engine/proc.py does (plus the HF tokenizer, as an LLM
process holds it), ``gc.collect()`` and, in "freeze" mode, ``gc.freeze()``; then push the
same workload through ``EngineCore.step()`` -- many requests, a new one arriving each
step while the batch is full, outputs kept as a frontend's journal would keep them, so
the heap grows and the collector runs its generations as in serving. Reported per mode:
p50 / p99 / p99.9 / max step time (the first --warmup-steps steps left out: lazy
initialisation, not the collector), the number of full (generation 2) collections, the
time spent in them and in the collector overall, and the p99 of the steps a full
collection ran in; then the ratio of the modes.

The modes alternate (no-freeze, freeze, no-freeze, ...) for --repeats rounds, so drift on
a shared machine hits both alike; each figure is the median over the rounds, and the
p99 of every round is listed too, so the noise is visible next to the effect.

A full collection runs only once the long-lived objects grew by a quarter since the last
one, so with ~330k objects from start-up it is rare: at the defaults (2048 x 32, about
65k journalled outputs) the no-freeze mode saw one, of ~190 ms on this CPU, and freeze
mode one of ~30 ms (one run each). Being rare, it moves max and p99.9 more than p99; a
run with no full collection in the no-freeze mode measures noise only, and says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _child(model: str, freeze: bool, num_requests: int, max_tokens: int, warmup_steps: int) -> dict:
    from planaria.engine.config import EngineConfig
    from planaria.engine.core import EngineCore
    from planaria.engine.llm import load_tokenizer
    from planaria.engine.messages import EngineCoreRequest
    from planaria.engine.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model=model, num_kv_blocks=2048, max_model_len=512, max_num_seqs=64,
                                   num_threads=1))
    tokenizer = load_tokenizer(model)
    gc.collect()
    if freeze:
        gc.freeze()
    pauses: list[tuple[int, float]] = []  # (generation, seconds) per collection
    started = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[info["generation"]] = time.perf_counter()
        elif info["generation"] in started:
            pauses.append((info["generation"], time.perf_counter() - started.pop(info["generation"])))

    gc.callbacks.append(on_gc)
    prompts = [tokenizer.encode(f"def function_{i}(x, y):\n    return x * {i} + y") for i in range(num_requests)]
    journal: dict[str, list] = {}  # outputs kept, as a replay journal keeps them
    steps: list[tuple[float, bool]] = []  # (step time, a full collection ran in it)
    submitted = 0
    while submitted < num_requests or core.has_unfinished_requests():
        for _ in range(4 if submitted < 64 else 1):
            if submitted < num_requests:
                core.add_request(EngineCoreRequest(
                    request_id=f"r{submitted}", prompt_token_ids=prompts[submitted],
                    sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=submitted,
                                                   ignore_eos=True)))
                submitted += 1
        num_gen2_before = sum(g == 2 for g, _ in pauses)
        t0 = time.perf_counter()
        outs, executed = core.step()
        dt = time.perf_counter() - t0
        if executed:
            steps.append((dt, sum(g == 2 for g, _ in pauses) > num_gen2_before))
        for o in outs:
            journal.setdefault(o.request_id, []).append(o)
    gc.callbacks.remove(on_gc)
    measured = steps[warmup_steps:] or steps
    step_s = sorted(dt for dt, _ in measured)
    gen2_steps = sorted(dt for dt, gen2 in measured if gen2)
    full = [p for g, p in pauses if g == 2]
    return {"mode": "freeze" if freeze else "no-freeze", "num_steps": len(step_s),
            "frozen_objects": gc.get_freeze_count(),
            "p50_ms": 1e3 * statistics.median(step_s), "p99_ms": 1e3 * _pct(step_s, 0.99),
            "p999_ms": 1e3 * _pct(step_s, 0.999),
            "max_ms": 1e3 * step_s[-1], "num_gen2": len(full), "gen2_ms": 1e3 * sum(full),
            "gen2_step_p99_ms": 1e3 * _pct(gen2_steps, 0.99) if gen2_steps else 0.0,
            "gc_total_ms": 1e3 * sum(p for _, p in pauses), "num_collections": len(pauses)}


def _pct(sorted_s: list[float], q: float) -> float:
    return sorted_s[int(q * (len(sorted_s) - 1))]


MODES = ("no-freeze", "freeze")
KEYS = ("num_steps", "frozen_objects", "p50_ms", "p99_ms", "p999_ms", "max_ms", "num_collections", "num_gen2",
        "gen2_ms", "gen2_step_p99_ms", "gc_total_ms")
TIMES = {"p50_ms", "p99_ms", "p999_ms", "max_ms", "gen2_ms", "gen2_step_p99_ms", "gc_total_ms"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-moe")
    p.add_argument("--model", help="a model directory (default: build the preset's demo model)")
    p.add_argument("--requests", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="rounds of (no-freeze, freeze), alternating")
    p.add_argument("--warmup-steps", type=int, default=5, help="first steps left out of the figures")
    p.add_argument("--json", help="also write every round's figures here")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.model, args.child == "freeze", args.requests, args.max_tokens,
                                args.warmup_steps)))
        return 0
    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="gc-bench-") as tmp:
        model = args.model
        if model is None:
            from planaria.engine.demo_model import build_demo_model

            model = str(build_demo_model(Path(tmp) / args.preset, args.preset))
        for r in range(args.repeats):
            for mode in MODES:
                out = subprocess.run([sys.executable, "-m", "bench.gc_freeze", "--child", mode, "--model", model,
                                      "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
                                      "--warmup-steps", str(args.warmup_steps)],
                                     check=True, capture_output=True, text=True)
                rounds[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1}/{args.repeats} {mode:>9}: p99 {rounds[mode][-1]['p99_ms']:.3f} ms, "
                      f"{rounds[mode][-1]['num_gen2']} full collections", file=sys.stderr, flush=True)
    med = {m: {k: statistics.median(x[k] for x in rounds[m]) for k in KEYS} for m in MODES}
    print(f"{args.requests} requests x {args.max_tokens} tokens, {args.repeats} round(s), "
          f"median of rounds (first {args.warmup_steps} steps left out)")
    print(f"{'':18}{'no-freeze':>14}{'freeze':>14}{'ratio':>10}")
    for k in KEYS:
        a, b = med["no-freeze"][k], med["freeze"][k]
        ratio = f"{a / b:.2f}x" if k in TIMES and b else "-"
        print(f"{k:18}{a:>14.3f}{b:>14.3f}{ratio:>10}" if k in TIMES else f"{k:18}{a:>14g}{b:>14g}{ratio:>10}")
    for m in MODES:
        print(f"p99_ms per round, {m:>9}: " + ", ".join(f"{x['p99_ms']:.3f}" for x in rounds[m]))
    if not any(x["num_gen2"] for x in rounds["no-freeze"]):
        print("no full collection ran in the no-freeze rounds: this run measured noise, not the "
              "freeze; give more --requests")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
