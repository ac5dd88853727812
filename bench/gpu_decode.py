"""bf16 decode on a CUDA GPU against the bandwidth floor (run by bench/gpu_check.sh).

    python -m bench.gpu_decode [--model DIR] [--conc 1,64] [--json FILE]

The model (default: the bench-moe demo checkpoint, built from its preset into a temporary
folder where none is given) runs in Planaria's engine on ``cuda`` in bfloat16: N sequences
of 128 prompt tokens, 64 greedy output tokens each. Reported per N: output tok/s, the mean
decode step, the time the step's weight reads alone would take at the GPU's measured
device-to-device copy bandwidth (weights touched: attention, the experts a batch of N
hits on average, router, embedding and head, in bf16), and step / floor. KV-cache reads
are left out of the floor, so the ratio overstates the gap at long contexts a little.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.engine_vs_transformers import prompts_for, run_planaria, weight_bytes_touched


def hbm_copy_bandwidth() -> float:
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # 512 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - t0)  # read + write


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--conc", default="1,64")
    ap.add_argument("--json")
    ap.add_argument("--compile", action="store_true", help="EngineConfig.compile (engine/compiled.py)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode: torch sees no CUDA device")
    concs = [int(c) for c in args.conc.split(",")]
    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model is None:
        from planaria.engine.demo_model import build_demo_model

        model = str(Path(tmp.name) / "bench-moe")
        build_demo_model(model, preset="bench-moe")
    from planaria.engine import LLM

    llm = LLM(model, device="cuda", dtype="bfloat16", max_num_seqs=max(concs),
              max_num_batched_tokens=max(2048, 128 * max(concs)), kv_cache_bytes=4 * 2**30,
              compile=args.compile)
    print(f"compiled decode: {llm.core.runner.compile_status}", flush=True)
    bw = hbm_copy_bandwidth()
    print(f"gpu={torch.cuda.get_device_name()} torch={torch.__version__} model={model} "
          f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    run_planaria(llm, prompts_for(2))  # warm-up
    rows = []
    print(f"{'seqs':>5} {'tok/s':>9} {'step ms':>8} {'overhead ms':>12} {'floor ms':>9} {'step/floor':>11}")
    for n in concs:
        tok_s, overhead_ms, step_ms = run_planaria(llm, prompts_for(n))
        floor_ms = 1000 * weight_bytes_touched(llm.core.runner.spec, n, elem=2) / (bw / 2)
        rows.append(dict(seqs=n, tok_s=round(tok_s, 1), decode_step_ms=round(step_ms, 3),
                         overhead_ms=round(overhead_ms, 3), floor_ms=round(floor_ms, 4),
                         step_over_floor=round(step_ms / floor_ms, 1)))
        print(f"{n:>5} {tok_s:>9.1f} {step_ms:>8.3f} {overhead_ms:>12.3f} {floor_ms:>9.4f} "
              f"{step_ms / floor_ms:>11.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
