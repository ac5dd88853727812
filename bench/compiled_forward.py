"""The compiled decode forward (EngineConfig.compile, engine/compiled.py) against the eager
one, side by side in one engine, and what compiling costs at start-up.

    .venv/bin/python -m bench.compiled_forward [--models smollm2,bench-moe] [--conc 1,16,32,64]
        [--reps 2] [--json FILE]

For each model: first the start-up, each in a fresh process: ``LLM(compile=True)`` with an
empty Inductor cache (cold: every graph generated and built) and again with the cache the
first one left (warm: what a restarted engine or a scale-up standby pays, given the
supervisor's ``<state dir>/compile-cache``), against ``LLM()`` without compiling. Then
in this process one engine with ``compile=True`` runs the offline workload of
bench/offline_vs_vllm.py (N sequences x 128 prompt tokens, 64 output tokens, greedy,
ignore_eos) alternately with the compiled graphs and with them switched off
(``runner.compiled = None``: the same weights, KV cache and kernels), ``--reps`` times
each; output tok/s are medians. Last, agreement: one decode batch of the largest N sequences run
both ways from the same state: top-1 agreement of the next token and the largest
log-probability difference.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.engine_vs_transformers import prompts_for, run_planaria
from bench.offline_vs_vllm import ensure_model, vocab_limit
from bench.step_overhead import parse_args

_STARTUP = """
import sys, time
t0 = time.monotonic()
from planaria.engine import LLM
llm = LLM(sys.argv[1], max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_bytes=2**30, compile=sys.argv[2] == "1")
print(round(time.monotonic() - t0, 2), llm.core.runner.compile_status)
"""


def startup_s(model: Path, compile_: bool, cache: str) -> tuple[float, str]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", _STARTUP, str(model), "1" if compile_ else "0"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    seconds, status = out.split(" ", 1)
    return float(seconds), status


def tok_s(llm, prompts) -> float:
    return run_planaria(llm, prompts)[0]


def agreement(llm, prompts) -> dict:
    """One decode step of len(prompts) sequences, eager and compiled, from the same KV."""
    import torch

    from planaria.engine import SamplingParams
    from planaria.engine.messages import EngineCoreRequest
    from planaria.kernels.attention import build_metadata

    core, runner = llm.core, llm.core.runner
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(request_id=f"a{i}", prompt_token_ids=p, sampling_params=sp))
    core.step()  # the prefills (eager) and their first tokens
    sched = core.scheduler.schedule()  # the decode step: blocks allocated
    ss = sched.scheduled
    ids = torch.tensor([s.req.all_token_ids[s.start_pos] for s in ss])
    positions = torch.tensor([s.start_pos for s in ss])
    out = {}
    for name, fn in (("eager", runner.model), ("compiled", runner.compiled)):
        # as ModelRunner.execute: the metadata outside inference mode (guards see dispatch keys)
        md = build_metadata([s.block_ids for s in ss], [s.start_pos + 1 for s in ss], [],
                            runner.block_size, runner.device)
        with torch.inference_mode():
            logits = runner.model.compute_logits(fn(ids, positions, runner.kv_caches, md))
            out[name] = torch.log_softmax(logits, dim=-1)
    core.scheduler.update_from_output(sched, out["eager"].argmax(-1).tolist())
    while core.has_unfinished_requests():
        core.step()
    top1 = (out["eager"].argmax(-1) == out["compiled"].argmax(-1)).float().mean().item()
    # logprob of eager's top token under both (check_logprobs_close in the manner of vLLM's tests)
    best = out["eager"].argmax(-1, keepdim=True)
    diff = (out["eager"].gather(1, best) - out["compiled"].gather(1, best)).abs().max().item()
    return dict(seqs=len(prompts), top1_agreement=round(top1, 4), max_top_logprob_diff=round(diff, 4))


def main() -> None:
    args, concs = parse_args(__doc__, reps=2)
    results = {}
    from planaria.engine import LLM

    for name in args.models.split(","):
        model = ensure_model(name)
        limit = vocab_limit(model)
        with tempfile.TemporaryDirectory(prefix="planaria-compile-cache-") as cache:
            eager_s, _ = startup_s(model, False, cache)
            cold_s, cold = startup_s(model, True, cache)
            warm_s, warm = startup_s(model, True, cache)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            print(f"{name}: start-up (fresh process) eager {eager_s:.1f} s; compile=True with an empty cache "
                  f"{cold_s:.1f} s [{cold}], with the cache {warm_s:.1f} s [{warm}]", flush=True)
            llm = LLM(str(model), max_num_seqs=max(concs), max_num_batched_tokens=2048, kv_cache_bytes=2**30,
                      compile=True)
            runner = llm.core.runner
            compiled = runner.compiled
            rows = []
            print(f"{'seqs':>5} {'eager tok/s':>12} {'compiled tok/s':>15} {'ratio':>6}")
            tok_s(llm, [[t % limit + 1 for t in p] for p in prompts_for(2)])  # warm-up
            for n in concs:
                ps = [[t % limit + 1 for t in p] for p in prompts_for(n)]
                got = {"eager": [], "compiled": []}
                for _ in range(args.reps):
                    for mode in ("eager", "compiled"):
                        runner.compiled = compiled if mode == "compiled" else None
                        got[mode].append(tok_s(llm, ps))
                runner.compiled = compiled
                e, c = statistics.median(got["eager"]), statistics.median(got["compiled"])
                rows.append(dict(seqs=n, eager_tok_s=round(e, 1), compiled_tok_s=round(c, 1), ratio=round(c / e, 2)))
                print(f"{n:>5} {e:>12.1f} {c:>15.1f} {c / e:>6.2f}", flush=True)
            agree = agreement(llm, [[t % limit + 1 for t in p] for p in prompts_for(max(concs), seed=1)])
            print(f"agreement at one decode step of {agree['seqs']} sequences: {agree}", flush=True)
            results[name] = dict(startup=dict(eager_s=eager_s, compile_cold_s=cold_s, compile_warm_s=warm_s),
                                 throughput=rows, agreement=agree, dtype=str(runner.dtype))
            del llm, runner, compiled
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
