"""The batch-invariant mode (EngineConfig.batch_invariant): what breaks invariance without
it, and what it costs.

    .venv/bin/python -m bench.batch_invariance [--part kernels,engine] [--models bench-moe,smollm2]
        [--conc 1,16,32,64] [--dtype bfloat16] [--json FILE]

kernels: for SmolLM2's linear shapes in bfloat16, how many of a batch's first rows differ
(any bit) from the same row computed alone, at M = 1 .. 2048 rows: oneDNN's packed GEMM
alone, the default routing (kernels/linear.py ``linear``: the skinny kernel up to
``max_rows`` rows, oneDNN past them), and ``invariant_linear``; then the time of each at
1-2048 rows, oneDNN against the invariant kernel and the skinny kernel, and the lm_head
(49152 x 576) both ways: the three called in turn ``--reps`` times after a warm-up, the
fastest call of each kept (on a shared 2-vCPU VM a call whose second thread is
descheduled takes a whole time slice, and medians caught those).

engine: offline throughput as in offline_vs_vllm.py (N sequences of 128 prompt tokens,
64 output tokens, greedy, ignore_eos) with the mode off and on: both engines loaded at
once, given the same prompts, and stepped in turn, one step each (so a busy spell of
this shared VM hits both alike); each side's output tokens over the sum of its own step
times, its median decode step, and the time of its steps that prefill. ``--rounds``
repeats each N and keeps each side's best round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.engine_vs_transformers import OUT_LEN, prompts_for
from bench.offline_vs_vllm import cpu_line, ensure_model, vocab_limit

SHAPES = {"qkv 576->960": (960, 576), "gate_up 576->3072": (3072, 576), "down 1536->576": (576, 1536)}
ROWS = [1, 2, 8, 9, 16, 32, 64, 128, 512, 2048]


def _rows_differing(fn, x: torch.Tensor) -> dict[int, int]:
    alone = torch.cat([fn(x[i:i + 1]) for i in range(64)])
    return {m: int((fn(x[:m])[:64] != alone[:min(m, 64)]).any(1).sum()) for m in ROWS}


def _fastest(fns: dict, reps: int) -> dict[str, float]:
    """Each fn called in turn ``reps`` times (after 3 warm-up rounds): its fastest call, ms."""
    best = dict.fromkeys(fns, float("inf"))
    for r in range(reps + 3):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r >= 3:
                best[name] = min(best[name], 1000 * (time.perf_counter() - t0))
    return best


def kernels(reps: int) -> list[dict]:
    from planaria.engine.models import packing
    from planaria.kernels import linear as lin

    rows = []
    onednn = lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")  # noqa: E731
    print(f"bf16 rows differing from the row alone (of the first 64), at M = {ROWS}; "
          f"skinny kernel up to {lin.max_rows(torch.bfloat16)} rows by default")
    for name, (n, k) in SHAPES.items():
        g = torch.Generator().manual_seed(n + k)
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(2048, k, generator=g).bfloat16()
        po, pi = packing.pack(w), lin.pack_invariant(w)
        diff = {"onednn": _rows_differing(lambda r: onednn(r, po), x),
                "default": _rows_differing(lambda r: lin.linear(r, w, None, po), x),
                "invariant": _rows_differing(lambda r: lin.invariant_linear(r, w, None, pi), x)}
        for kind, d in diff.items():
            print(f"  {name:<18} {kind:<9} " + " ".join(f"{d[m]:>3}" for m in ROWS), flush=True)
            rows.append(dict(op="rows_differing", shape=name, kernel=kind, **{str(m): d[m] for m in ROWS}))
    print("bf16 ms (fastest call): oneDNN packed, skinny, invariant (ratio invariant / oneDNN)")
    shapes = dict(SHAPES, **{"lm_head 576->49152": (49152, 576)})
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k).bfloat16()
        po, pi = packing.pack(w), lin.pack_invariant(w)
        for m in (1, 16, 32, 64, 256, 2048):
            if n > 10000 and m > 64:
                continue
            x = torch.randn(m, k).bfloat16()
            r = reps if m <= 64 else max(3, reps // 6)
            t = _fastest({"onednn": lambda: onednn(x, po),
                          "skinny": lambda: torch.ops.planaria.skinny_linear(x, w, None),
                          "invariant": lambda: lin.invariant_linear(x, w, None, pi)}, r)
            a, s, c = t["onednn"], t["skinny"], t["invariant"]
            print(f"  {name:<18} {m:>5} rows  oneDNN {a:8.4f}  skinny {s:8.4f}  invariant {c:8.4f}  {c / a:5.2f}x",
                  flush=True)
            rows.append(dict(op="linear_ms", shape=name, rows=m, onednn_ms=round(a, 4), skinny_ms=round(s, 4),
                             invariant_ms=round(c, 4)))
    return rows


def _run(llms: dict, prompts) -> dict:
    """Per engine: (output tok/s, median decode step ms, prefill steps ms), the engines
    stepped in turn on the same prompts."""
    from planaria.engine import SamplingParams
    from planaria.engine.messages import EngineCoreRequest

    sp = SamplingParams(temperature=0.0, max_tokens=OUT_LEN, ignore_eos=True)
    stats = {}
    for key, llm in llms.items():
        llm.core.reset_prefix_cache()  # every round prefills its prompts
        for i, p in enumerate(prompts):
            llm.core.add_request(EngineCoreRequest(request_id=f"b{time.monotonic_ns()}-{i}", prompt_token_ids=p,
                                                   sampling_params=sp))
        stats[key] = {"out": 0, "busy": 0.0, "decode": [], "prefill": 0.0}
    while any(llm.core.has_unfinished_requests() for llm in llms.values()):
        for key, llm in llms.items():
            core, st = llm.core, stats[key]
            if not core.has_unfinished_requests():
                continue
            s0 = time.perf_counter()
            outs, _ = core.step()
            dt = time.perf_counter() - s0
            st["out"] += sum(len(o.new_token_ids) for o in outs)
            st["busy"] += dt
            if core.runner.last_num_tokens == len(prompts):
                st["decode"].append(dt)
            else:
                st["prefill"] += dt
    return {key: (st["out"] / st["busy"], 1000 * statistics.median(st["decode"]), 1000 * st["prefill"])
            for key, st in stats.items()}


def engine(models: list[str], concs: list[int], dtype: str, rounds: int) -> list[dict]:
    from planaria.engine import LLM

    rows = []
    for name in models:
        model = ensure_model(name)
        limit = vocab_limit(model)
        clip = lambda ps: [[t % limit + 3 for t in p] for p in ps]  # noqa: E731
        llms = {mode: LLM(str(model), dtype=dtype, batch_invariant=mode, max_num_seqs=max(concs),
                          max_num_batched_tokens=2048, kv_cache_bytes=512 * 2**20) for mode in (False, True)}
        _run(llms, clip(prompts_for(2)))  # warm-up
        print(f"\n{name} {dtype}: output tok/s, median decode step ms, prefill ms; mode off | on | on/off tok/s")
        for n in concs:
            runs = [_run(llms, clip(prompts_for(n))) for _ in range(rounds)]
            off, on = (max((r[mode] for r in runs), key=lambda t: t[0]) for mode in (False, True))
            print(f"{n:>5} seqs  {off[0]:8.1f} {off[1]:7.1f} {off[2]:8.0f} | {on[0]:8.1f} {on[1]:7.1f} {on[2]:8.0f}"
                  f" | {on[0] / off[0]:5.2f}", flush=True)
            rows.append(dict(model=name, dtype=dtype, seqs=n, off_tok_s=round(off[0], 1), on_tok_s=round(on[0], 1),
                             off_decode_ms=round(off[1], 2), on_decode_ms=round(on[1], 2),
                             off_prefill_ms=round(off[2]), on_prefill_ms=round(on[2])))
        del llms
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="kernels,engine")
    ap.add_argument("--models", default="bench-moe,smollm2")
    ap.add_argument("--conc", default="1,16,32,64")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from planaria.kernels import cpu_ext

    print(f"cpu: {cpu_line()}; torch threads {torch.get_num_threads()}; C++ kernels: {cpu_ext.status()}")
    parts = args.part.split(",")
    results = []
    if "kernels" in parts:
        results += kernels(args.reps)
    if "engine" in parts:
        results += engine(args.models.split(","), [int(c) for c in args.conc.split(",")], args.dtype, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
