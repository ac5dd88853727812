"""Per-step CPU time outside the forward, at N running sequences (issue 13's < 1 ms goal).

    .venv/bin/python -m bench.step_overhead [--models smollm2,bench-moe] [--conc 1,16,32,64]
        [--reps 3] [--json FILE]

Drives the engine core in this process (``LLM(...).core.step()``) with the workload of
bench/offline_vs_vllm.py: N sequences of 128 prompt tokens, 64 output tokens each, greedy,
ignore_eos, default dtype. For every decode step of all N sequences it takes the step's wall
time minus the time inside the model forward and the lm_head (``model.forward``, and
``model.compute_logits`` or, for plain greedy batches, ``model.greedy_tokens``, timed by
wrappers): what is left is scheduling, laying out the inputs and attention metadata,
sampling, applying the tokens and building the outputs. Where ``greedy_tokens`` takes
the argmax inside the lm_head (kernels/linear.py ``linear_argmax``), the argmax is not
counted outside; so that nothing hides there, the ``lm_head`` columns time, on the same
[N, hidden] input, the lm_head alone (logits written out), with a separate argmax, and
fused: the fused op's time minus the lm_head alone is what the argmax costs (printed as
``argmax+``, added to nothing when it is negative). Reports the median, mean and 90th
percentile over ``--reps`` runs, and the medians of the parts (timed by wrappers around
``Scheduler.schedule``, ``build_metadata``, ``SamplingMetadata.build``, the sampler and
``EngineCore._update``). This VM's timings move 10-30% from run to run, with the forward.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

from bench.engine_vs_transformers import OUT_LEN, prompts_for
from bench.offline_vs_vllm import cpu_line, ensure_model, vocab_limit

PARTS = ("schedule", "attn_metadata", "sampling_metadata", "sampler", "update")


def measure(model: Path, concs: list[int], reps: int) -> list[dict]:
    import planaria.engine.model_runner as model_runner
    from planaria.engine import LLM, SamplingParams
    from planaria.engine.messages import EngineCoreRequest

    llm = LLM(str(model), max_num_seqs=max(concs), max_num_batched_tokens=2048, kv_cache_bytes=2 * 2**30)
    core, runner = llm.core, llm.core.runner
    cur: dict[str, float] = collections.defaultdict(float)

    def timed(obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                cur[key] += time.perf_counter() - t0
        setattr(obj, attr, wrapper)

    timed(runner.model, "forward", "forward")
    timed(runner.model, "compute_logits", "forward")
    timed(runner.model, "greedy_tokens", "forward")
    timed(core.scheduler, "schedule", "schedule")
    timed(model_runner, "build_metadata", "attn_metadata")
    timed(model_runner.SamplingMetadata, "build", "sampling_metadata")
    timed(runner, "sampler", "sampler")
    timed(core, "_update", "update")
    limit = vocab_limit(model)
    sp = SamplingParams(temperature=0.0, max_tokens=OUT_LEN, ignore_eos=True)

    def run(n: int) -> dict[str, list[float]]:
        for i, p in enumerate(prompts_for(n)):
            core.add_request(EngineCoreRequest(request_id=f"s{time.monotonic_ns()}-{i}",
                                               prompt_token_ids=[t % limit + 1 for t in p], sampling_params=sp))
        got: dict[str, list[float]] = collections.defaultdict(list)
        while core.has_unfinished_requests():
            cur.clear()
            t0 = time.perf_counter()
            core.step()
            dt = time.perf_counter() - t0
            if runner.last_num_tokens == n:  # a decode step of all n sequences
                got["outside"].append(dt - cur["forward"])
                got["forward"].append(cur["forward"])
                for k in PARTS:
                    got[k].append(cur[k])
        return got

    run(2)  # warm-up
    rows = []
    for n in concs:
        got: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(reps):
            for k, v in run(n).items():
                got[k] += v
        out = sorted(got["outside"])
        row = dict(seqs=n, steps=len(out), forward_ms=round(1000 * statistics.median(got["forward"]), 2),
                   outside_median_ms=round(1000 * statistics.median(out), 3),
                   outside_mean_ms=round(1000 * statistics.mean(out), 3),
                   outside_p90_ms=round(1000 * out[int(0.9 * (len(out) - 1))], 3))
        row.update({f"{k}_ms": round(1000 * statistics.median(got[k]), 3) for k in PARTS})
        row.update(lm_head_costs(runner, n))
        # the figure of the goal: outside the forward, plus the fused argmax's own cost if any
        row["outside_counted_ms"] = round(row["outside_median_ms"] + max(0.0, row["argmax_extra_ms"]), 3)
        rows.append(row)
        print(f"{n:>5} {row['forward_ms']:>10.2f} {row['outside_median_ms']:>9.3f} {row['outside_mean_ms']:>8.3f} "
              f"{row['outside_p90_ms']:>8.3f}  " + " ".join(f"{row[k + '_ms']:>8.3f}" for k in PARTS)
              + f"  lm_head {row['lm_head_alone_ms']:.2f} / +argmax {row['lm_head_then_argmax_ms']:.2f}"
              f" / fused {row['lm_head_fused_ms']:.2f} (argmax+ {row['argmax_extra_ms']:+.3f});"
              f" counted {row['outside_counted_ms']:.3f}", flush=True)
    del llm, core, runner  # the next model's engine gets the memory
    return rows


def lm_head_costs(runner, n: int, reps: int = 7) -> dict[str, float]:
    """Median ms of the lm_head on an [n, hidden] input: logits alone, then a separate
    argmax, and greedy_tokens (fused where the kernels allow)."""
    import torch

    from bench.cpu_kernels import timed
    from planaria.kernels.sampling import argmax_rows

    model = runner.model
    w = model.lm_head_weight()
    x = torch.randn(n, w.shape[1], generator=torch.Generator().manual_seed(n)).to(w.dtype)

    with torch.inference_mode():
        alone = timed(lambda: model.compute_logits(x, float32=False), reps)
        separate = timed(lambda: argmax_rows(model.compute_logits(x, float32=False)), reps)
        fused = timed(lambda: model.greedy_tokens(x), reps)
    return dict(lm_head_alone_ms=round(alone, 3), lm_head_then_argmax_ms=round(separate, 3),
                lm_head_fused_ms=round(fused, 3), argmax_extra_ms=round(fused - alone, 3))


def parse_args(doc: str, reps: int) -> tuple[argparse.Namespace, list[int]]:
    """--models, --conc, --reps, --json of the in-process engine benchmarks (this one and
    bench/compiled_forward.py); prints the host line."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,bench-moe")
    ap.add_argument("--conc", default="1,16,32,64")
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    print(f"host: {cpu_line()}")
    return args, [int(c) for c in args.conc.split(",")]


def main() -> None:
    args, concs = parse_args(__doc__, reps=3)
    results = {}
    for name in args.models.split(","):
        model = ensure_model(name)
        print(f"{name}: per decode step, ms (medians; outside = step - forward - lm_head)")
        print(f"{'seqs':>5} {'forward':>10} {'outside':>9} {'mean':>8} {'p90':>8}  "
              + " ".join(f"{k[:8]:>8}" for k in PARTS))
        results[name] = measure(model, concs, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
