"""Engine throughput vs transformers `generate`, side by side in one run.

    .venv/bin/python -m bench.engine_vs_transformers [--model DIR] [--conc 1,16,32,64]

Model: the bench-moe demo checkpoint (built into .state/models/bench-moe when missing).
Workload per point: N sequences of 128 random prompt tokens, 64 output tokens each
(ignore_eos; transformers with min_new_tokens = max_new_tokens = 64, batch of N, no
padding needed since all prompts have the same length). float32 on CPU.

Reports output tokens/s for both, the ratio, the per-step CPU overhead outside the model
forward (step wall time minus forward time, averaged over decode steps), and the decode
step time against a memory-bandwidth floor: weight bytes touched per step divided by the
measured copy bandwidth of this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

PROMPT_LEN, OUT_LEN = 128, 64


def ensure_model(path: Path) -> str:
    if not (path / "config.json").is_file():
        from planaria.engine.demo_model import build_demo_model

        build_demo_model(path, preset="bench-moe")
    return str(path)


def prompts_for(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed + n)
    return [[rng.randrange(3, 4000) for _ in range(PROMPT_LEN)] for _ in range(n)]


def copy_bandwidth_bytes_s() -> float:
    src = torch.ones(64 * 2**20 // 4 * 4)  # 256 MB
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    dt = (time.perf_counter() - t0) / 5
    return 2 * src.numel() * 4 / dt  # read + write


def run_planaria(llm, prompts):
    from planaria.engine import SamplingParams
    from planaria.engine.messages import EngineCoreRequest

    core = llm.core
    sp = SamplingParams(temperature=0.0, max_tokens=OUT_LEN, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(request_id=f"b{time.monotonic_ns()}-{i}", prompt_token_ids=p,
                                           sampling_params=sp))
    n_out = 0
    steps = []
    t0 = time.perf_counter()
    while core.has_unfinished_requests():
        fwd0 = core.runner.forward_s
        s0 = time.perf_counter()
        outs, _ = core.step()
        dt = time.perf_counter() - s0
        n_out += sum(len(o.new_token_ids) for o in outs)
        steps.append((dt, core.runner.forward_s - fwd0, core.runner.last_num_tokens))
    wall = time.perf_counter() - t0
    decode = [(dt, f) for dt, f, ntok in steps if ntok == len(prompts)]
    overhead_ms = 1000 * sum(dt - f for dt, f in decode) / max(1, len(decode))
    step_ms = 1000 * sum(dt for dt, _ in decode) / max(1, len(decode))
    return n_out / wall, overhead_ms, step_ms


def run_transformers(hf, prompts):
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=OUT_LEN, min_new_tokens=OUT_LEN, pad_token_id=0)
        wall = time.perf_counter() - t0
    return (out.shape[1] - PROMPT_LEN) * len(prompts) / wall


def weight_bytes_touched(spec, batch: int, elem: int = 4) -> int:
    """Bytes of weights a decode step of `batch` tokens reads (experts: expected hits);
    ``elem`` bytes per weight (4: float32, 2: bfloat16)."""
    h = spec.hidden_size
    attn = h * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim + spec.num_heads * spec.head_dim * h
    expert = 3 * h * spec.moe_intermediate_size
    e, k = spec.num_experts, spec.top_k
    hit = e * (1 - (1 - k / e) ** batch)
    per_layer = attn + hit * expert + e * h
    return int(elem * (spec.num_layers * per_layer + 2 * spec.vocab_size * h))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.environ.get("BENCH_MODEL", ".state/models/bench-moe"))
    ap.add_argument("--conc", default="1,16,32,64")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    model = ensure_model(Path(args.model))
    concs = [int(c) for c in args.conc.split(",")]
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM

    from planaria.engine import LLM

    llm = LLM(model, max_num_seqs=max(concs), max_num_batched_tokens=max(2048, PROMPT_LEN * 16),
              kv_cache_bytes=2 * 2**30)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    bw = copy_bandwidth_bytes_s()
    print(f"model={model} threads={torch.get_num_threads()} copy_bandwidth={bw / 1e9:.1f} GB/s")
    run_planaria(llm, prompts_for(2))  # warm-up both
    run_transformers(hf, prompts_for(2)[:1])
    rows = []
    print(f"{'seqs':>5} {'planaria tok/s':>15} {'transformers tok/s':>19} {'ratio':>6} "
          f"{'step ms':>8} {'overhead ms':>12} {'bw floor ms':>12}")
    for n in concs:
        ps = prompts_for(n)
        ours, overhead_ms, step_ms = run_planaria(llm, ps)
        theirs = run_transformers(hf, ps)
        floor_ms = 1000 * weight_bytes_touched(llm.core.runner.spec, n) / bw
        rows.append(dict(seqs=n, planaria_tok_s=round(ours, 1), transformers_tok_s=round(theirs, 1),
                         ratio=round(ours / theirs, 2), decode_step_ms=round(step_ms, 2),
                         overhead_ms=round(overhead_ms, 3), bandwidth_floor_ms=round(floor_ms, 2)))
        print(f"{n:>5} {ours:>15.1f} {theirs:>19.1f} {ours / theirs:>6.2f} {step_ms:>8.2f} "
              f"{overhead_ms:>12.3f} {floor_ms:>12.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
