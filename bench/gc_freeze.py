"""Step-time percentiles with and without ``gc.freeze()`` after engine start-up.

    python -m bench.gc_freeze [--preset tiny-moe] [--requests 512] [--max-tokens 48]

Each mode runs in a fresh child process (the freeze cannot be undone cleanly in one
process): build the EngineCore as engine/proc.py does (plus the HF tokenizer, as an LLM
process holds it), ``gc.collect()`` and, in "freeze" mode, ``gc.freeze()``; then push the
same workload through ``EngineCore.step()`` -- many requests, a new one arriving each
step while the batch is full, outputs kept as a frontend's journal would keep them, so
the heap grows and the collector runs its generations as in serving. Reported per mode:
p50 / p99 / max step time, the number of full (generation 2) collections and the time
spent in the collector; then the ratio of the two modes.
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


def _child(model: str, freeze: bool, num_requests: int, max_tokens: int) -> dict:
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.llm import load_tokenizer
    from engine.messages import EngineCoreRequest
    from engine.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model=model, num_kv_blocks=2048, max_model_len=512, max_num_seqs=64,
                                   num_threads=1))
    tokenizer = load_tokenizer(model)
    gc.collect()
    if freeze:
        gc.freeze()
    pauses: list[float] = []
    started = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[info["generation"]] = time.perf_counter()
        elif info["generation"] in started:
            pauses.append((info["generation"], time.perf_counter() - started.pop(info["generation"])))

    gc.callbacks.append(on_gc)
    prompts = [tokenizer.encode(f"def function_{i}(x, y):\n    return x * {i} + y") for i in range(num_requests)]
    journal: dict[str, list] = {}  # outputs kept, as a replay journal keeps them
    step_s: list[float] = []
    submitted = 0
    while submitted < num_requests or core.has_unfinished_requests():
        for _ in range(4 if submitted < 64 else 1):
            if submitted < num_requests:
                core.add_request(EngineCoreRequest(
                    request_id=f"r{submitted}", prompt_token_ids=prompts[submitted],
                    sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=submitted,
                                                   ignore_eos=True)))
                submitted += 1
        t0 = time.perf_counter()
        outs, executed = core.step()
        dt = time.perf_counter() - t0
        if executed:
            step_s.append(dt)
        for o in outs:
            journal.setdefault(o.request_id, []).append(o)
    gc.callbacks.remove(on_gc)
    step_s.sort()
    full = [p for g, p in pauses if g == 2]
    return {"mode": "freeze" if freeze else "no-freeze", "num_steps": len(step_s),
            "frozen_objects": gc.get_freeze_count(),
            "p50_ms": 1e3 * statistics.median(step_s), "p99_ms": 1e3 * step_s[int(0.99 * (len(step_s) - 1))],
            "max_ms": 1e3 * step_s[-1], "num_gen2": len(full), "gen2_ms": 1e3 * sum(full),
            "gc_total_ms": 1e3 * sum(p for _, p in pauses), "num_collections": len(pauses)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-moe")
    p.add_argument("--model", help="a model directory (default: build the preset's demo model)")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--child", choices=["freeze", "no-freeze"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.model, args.child == "freeze", args.requests, args.max_tokens)))
        return 0
    with tempfile.TemporaryDirectory(prefix="gc-bench-") as tmp:
        model = args.model
        if model is None:
            from engine.demo_model import build_demo_model

            model = str(build_demo_model(Path(tmp) / args.preset, args.preset))
        results = {}
        for mode in ("no-freeze", "freeze"):
            out = subprocess.run([sys.executable, "-m", "bench.gc_freeze", "--child", mode, "--model", model,
                                  "--requests", str(args.requests), "--max-tokens", str(args.max_tokens)],
                                 check=True, capture_output=True, text=True)
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    keys = ("num_steps", "frozen_objects", "p50_ms", "p99_ms", "max_ms", "num_collections", "num_gen2",
            "gen2_ms", "gc_total_ms")
    print(f"{'':16}{'no-freeze':>14}{'freeze':>14}{'ratio':>10}")
    for k in keys:
        a, b = results["no-freeze"][k], results["freeze"][k]
        ratio = f"{a / b:.2f}x" if b else "-"
        print(f"{k:16}{a:>14.3f}{b:>14.3f}{ratio:>10}" if isinstance(a, float) else f"{k:16}{a:>14}{b:>14}{ratio:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
