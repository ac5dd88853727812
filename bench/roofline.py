"""One decode step against this host's roofline: how close the engine comes to the memory
bandwidth at one sequence and to the GEMM peak at 64 (issue 28).

    .venv/bin/python -m bench.roofline [--models bench-moe,smollm2] [--seqs 1,64]
        [--dtype auto|bfloat16|float32] [--profile short|always|never] [--json FILE]

The host's limits, all threads, best of ``--reps``:

- GEMM peak, bf16 and fp32: square matmuls (``--gemm-sizes``) through ``torch.mm``, and
  in bf16 also through oneDNN's packed weight (``torch.ops.mkldnn._linear_pointwise``,
  what engine/models/packing.py gives the linears); the faster path is the peak.
- Memory bandwidth: a streaming read (a float32 sum) of a ``--buffer-mib`` buffer, far
  larger than the caches, and a copy (read + write bytes counted). The read is the floor's
  bandwidth: a decode step reads weights and KV and writes almost nothing.

Per model (the checkpoints of bench/offline_vs_vllm.py, built into .state/models when
missing) and per N in ``--seqs``: N sequences of 128 prompt tokens, 64 output tokens,
greedy, through the real engine core in this process (``LLM(...).core.step()``), one
warm-up batch first. Every step that decodes all N sequences and nothing else, past the
first ``--skip`` of them, is timed (context 129-192, about 160 tokens). For one such step:

- FLOPs: 2 per multiply-add of every matmul: the linears, the router, each token's top_k
  experts, attention over the context (QK^T and PV), the lm_head. Norms, rotary and
  activations are left out (well under 1%).
- Bytes: the linear weights the step reads (for a MoE layer the router and only the
  experts the batch's tokens route to, counted from the real routing of the timed steps;
  the uniform-routing expectation ``E (1 - (1 - k/E)^N)`` is printed beside it), the KV
  cache read (K and V of the whole context, plus the new token's write), the embedding
  rows and the lm_head. Activations are left out (they stay in cache).
- Step time: the median wall time of ``core.step()`` (schedule, forward, lm_head, sample,
  update), and its part in the forward and lm_head (``runner.forward_s``).

Reported: both fractions for every N, the bandwidth floor's (bytes / read bandwidth, over
the step time) and the GEMM peak's (flops / peak), and the bound that applies (the larger
of the two limits). The goals: >= 60% of the bandwidth floor at 1 sequence, >= 60% of the
GEMM peak at 64. Where a goal is missed (``--profile short``, the default) the script
profiles a few more such steps with torch.profiler and prints the top ops by self CPU time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

import planaria.engine.model_runner as model_runner
import planaria.engine.models.decoder as decoder
from bench.engine_vs_transformers import PROMPT_LEN, prompts_for
from bench.offline_vs_vllm import cpu_line, ensure_model, vocab_limit
from planaria.engine import LLM, SamplingParams
from planaria.engine.dtype import choose_dtype
from planaria.engine.messages import EngineCoreRequest
from planaria.engine.models import packing

GOAL_FRACTION = 0.6
GOALS = {1: "bandwidth", 64: "gemm"}  # seqs -> the limit issue 28 holds that step to


# -- the host's limits ----------------------------------------------------------------------------

def _best_s(fn, reps: int) -> float:
    fn()  # warm: first touch, oneDNN primitive creation
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_peak(dtype: torch.dtype, sizes: tuple[int, ...] = (1024, 2048, 3072), reps: int = 5) -> dict:
    """Best GFLOP/s of an [n, n] x [n, n] matmul over ``sizes``, per path: torch.mm, and for
    bf16 where oneDNN packs weights, the packed linear. ``peak_gflops`` is the best of all."""
    paths: dict[str, float] = collections.defaultdict(float)
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, generator=gen).to(dtype)
        w = torch.randn(n, n, generator=gen).to(dtype)
        flops = 2 * n ** 3
        paths["torch.mm"] = max(paths["torch.mm"], flops / _best_s(lambda: torch.mm(a, w), reps) / 1e9)
        if packing.available(torch.device("cpu"), dtype):
            packed = packing.pack(w)
            s = _best_s(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), reps)
            paths["onednn packed"] = max(paths["onednn packed"], flops / s / 1e9)
    best = max(paths, key=paths.get)
    return dict(dtype=str(dtype).removeprefix("torch."), peak_gflops=paths[best], path=best,
                paths={k: round(v, 1) for k, v in paths.items()}, sizes=list(sizes))


def memory_bandwidth(buffer_bytes: int = 512 * 2**20, reps: int = 5) -> dict:
    """GB/s of a streaming read (float32 sum) and of a copy (read + write counted)."""
    src = torch.ones(buffer_bytes // 4)
    dst = torch.empty_like(src)
    read = buffer_bytes / _best_s(lambda: src.sum(), reps) / 1e9
    copy = 2 * buffer_bytes / _best_s(lambda: dst.copy_(src), reps) / 1e9
    return dict(read_gb_s=read, copy_gb_s=copy, buffer_mib=buffer_bytes // 2**20)


# -- what one decode step costs -------------------------------------------------------------------

@dataclass(frozen=True)
class StepCost:
    """One decode step of ``num_seqs`` sequences at ``ctx_len`` tokens of context each."""

    linear_flops: float  # attention projections, MLPs, routers, the experts' top_k per token
    attention_flops: float  # QK^T and PV over the context
    lm_head_flops: float
    weight_bytes: float  # the layers' linear weights read (MoE: the experts hit only)
    kv_bytes: float  # K and V of the context read, the new token's written
    lm_head_bytes: float
    embed_bytes: float  # the embedding rows of the step's tokens

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops + self.lm_head_flops

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.lm_head_bytes + self.embed_bytes


def expected_experts_hit(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Distinct experts N tokens route to, in expectation, each picking top_k of E uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


def step_cost(spec, num_seqs: int, ctx_len: float, elem_bytes: int, experts_hit: float | None = None) -> StepCost:
    """``spec``: the engine's ModelSpec. ``experts_hit``: distinct experts read per MoE layer
    (counted from the routing), or None for ``expected_experts_hit``."""
    n, h, d = num_seqs, spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    attn_macs = h * (q + 2 * kv) + q * h  # per token: qkv, o_proj
    attn_params = attn_macs + (q + 2 * kv if spec.qkv_bias else 0)  # the bias is read, and added (not a MAC)
    dense_params = 3 * h * spec.intermediate_size  # gate, up, down
    expert_params = 3 * h * spec.moe_intermediate_size
    if spec.is_moe and experts_hit is None:
        experts_hit = expected_experts_hit(spec.num_experts, spec.top_k, n)
    num_moe = len(spec.sparse_layers) if spec.is_moe else 0
    num_dense = spec.num_layers - num_moe
    layer_macs = n * (spec.num_layers * attn_macs + num_dense * dense_params
                      + num_moe * (h * spec.num_experts + spec.top_k * expert_params))
    read_params = (spec.num_layers * attn_params + num_dense * dense_params
                   + num_moe * (h * spec.num_experts + (experts_hit or 0) * expert_params))
    return StepCost(
        linear_flops=2.0 * layer_macs,
        attention_flops=2.0 * spec.num_layers * n * spec.num_heads * d * ctx_len * 2,
        lm_head_flops=2.0 * n * h * spec.vocab_size,
        weight_bytes=float(read_params * elem_bytes),
        kv_bytes=float(spec.num_layers * n * 2 * kv * (ctx_len + 1) * elem_bytes),
        lm_head_bytes=float(spec.vocab_size * h * elem_bytes),
        embed_bytes=float(n * h * elem_bytes),
    )


# -- the engine's decode steps --------------------------------------------------------------------

@contextlib.contextmanager
def _recorded(module, name: str, record):
    """``module.name`` wrapped so that every call's arguments and result go to ``record``."""
    fn = getattr(module, name)

    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        record(args, out)
        return out
    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, fn)


class DecodeRun(NamedTuple):
    """What ``decode_steps`` saw: per timed step (wall s, forward s, mean context, distinct
    experts per MoE layer), and the profiler, if one ran, over ``num_profiled`` steps that
    took ``profiled_s`` of wall time in all."""

    steps: list[tuple[float, float, float, list[int]]]
    profiler: torch.profiler.profile | None = None
    num_profiled: int = 0
    profiled_s: float = 0.0


def decode_steps(llm, num_seqs: int, out_len: int, skip: int, profile_steps: int = 0) -> DecodeRun:
    """Runs ``num_seqs`` sequences to ``out_len`` tokens; times each step that decoded all of
    them and nothing else, past the first ``skip``. With ``profile_steps``, the first that
    many of those run under torch.profiler instead (untimed; a step of another kind, if one
    comes first, is the profile's last)."""
    core, runner = llm.core, llm.core.runner
    limit = vocab_limit(Path(runner.model_dir))
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts_for(num_seqs)):
        core.add_request(EngineCoreRequest(request_id=f"r{time.monotonic_ns()}-{i}",
                                           prompt_token_ids=[t % limit + 1 for t in p], sampling_params=sp))
    routed: list[torch.Tensor] = []  # this step's top-k ids [T, K], one per MoE layer
    ctx: list[list[int]] = []  # this step's decode context lengths, per build_metadata call
    steps, num_decode, num_profiled, profiled_s = [], 0, 0, 0.0
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile_steps else None
    with _recorded(decoder, "route", lambda a, out: routed.append(out[1])), \
            _recorded(model_runner, "build_metadata", lambda a, out: ctx.append(list(a[1]))):
        while core.has_unfinished_requests():
            routed.clear()
            ctx.clear()
            # past `skip` decode-only steps, the next ones are decode-only too (until some finish)
            profiling = prof is not None and num_decode >= skip and num_profiled < profile_steps
            if profiling and num_profiled == 0:
                prof.start()
            fwd0, t0 = runner.forward_s, time.perf_counter()
            core.step()
            dt = time.perf_counter() - t0
            decode_all = runner.last_num_tokens == num_seqs and bool(ctx) and len(ctx[0]) == num_seqs
            num_decode += decode_all
            if profiling:
                num_profiled += 1
                profiled_s += dt
                if not decode_all:  # the batch began to finish: the profile ends here
                    profile_steps = num_profiled
                if num_profiled == profile_steps:
                    prof.stop()
            elif decode_all and num_decode > skip:
                hit = [int(ids.unique().numel()) for ids in routed]
                steps.append((dt, runner.forward_s - fwd0, statistics.mean(ctx[0]), hit))
    if prof is not None and 0 < num_profiled < profile_steps:
        prof.stop()
    return DecodeRun(steps, prof if num_profiled else None, num_profiled, profiled_s)


def measure(llm, num_seqs: int, out_len: int, skip: int, peak: dict, bandwidth: dict) -> dict:
    """The row of the table for one N: cost, time, fractions."""
    runner = llm.core.runner
    steps = decode_steps(llm, num_seqs, out_len, skip).steps
    if not steps:
        raise RuntimeError(f"no step decoded all {num_seqs} sequences past the first {skip}: "
                           "raise the output length or lower --skip")
    spec = runner.spec
    elem = torch.empty((), dtype=runner.dtype).element_size()
    ctx_len = statistics.mean(s[2] for s in steps)
    hits = [h for s in steps for h in s[3]]
    counted = statistics.mean(hits) if hits else None
    cost = step_cost(spec, num_seqs, ctx_len, elem, counted)
    step_s = statistics.median(s[0] for s in steps)
    forward_s = statistics.median(s[1] for s in steps)
    floor_s = cost.bytes / (bandwidth["read_gb_s"] * 1e9)
    compute_s = cost.flops / (peak["peak_gflops"] * 1e9)
    row = dict(seqs=num_seqs, steps=len(steps), ctx_len=round(ctx_len, 1), gflop=cost.flops / 1e9,
               mb=cost.bytes / 1e6, cost=asdict(cost),
               experts_hit=counted, experts_expected=(expected_experts_hit(spec.num_experts, spec.top_k, num_seqs)
                                                      if spec.is_moe else None),
               step_ms=1e3 * step_s, forward_ms=1e3 * forward_s, floor_ms=1e3 * floor_s, compute_ms=1e3 * compute_s,
               bandwidth_fraction=floor_s / step_s, gemm_fraction=compute_s / step_s,
               bound="memory" if floor_s >= compute_s else "compute", goal=GOALS.get(num_seqs))
    if row["goal"]:
        row["goal_met"] = row[f"{row['goal']}_fraction"] >= GOAL_FRACTION
    return row


def profile_table(llm, num_seqs: int, out_len: int, skip: int, num_steps: int = 5,
                  top: int = 12) -> dict:
    """The top ops by self CPU time over ``num_steps`` decode steps of ``num_seqs``
    sequences, and those steps' wall time (the profiler's own cost in it)."""
    run = decode_steps(llm, num_seqs, out_len, skip, profile_steps=num_steps)
    if run.profiler is None:
        return dict(steps=0, step_ms=0.0, ops=[])
    events = sorted(run.profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    n = run.num_profiled
    ops = [dict(op=e.key, calls_per_step=e.count / n, self_ms_per_step=e.self_cpu_time_total / 1e3 / n,
                share=e.self_cpu_time_total / total) for e in events[:top]]
    return dict(steps=n, step_ms=1e3 * run.profiled_s / n, ops=ops)


# -- the report ------------------------------------------------------------------------------------

def render_host(host: str, dtype: str, threads: int, peaks: dict[str, dict], bandwidth: dict) -> str:
    gemm = "; ".join(f"{p['dtype']} GEMM {p['peak_gflops']:.0f} GFLOP/s ({p['path']}; "
                     + ", ".join(f"{k} {v:.0f}" for k, v in p["paths"].items()) + ")" for p in peaks.values())
    return (f"host: {host}; torch threads {threads}; engine dtype {dtype}\n"
            f"peaks (best of square matmuls {peaks[next(iter(peaks))]['sizes']}): {gemm}\n"
            f"memory ({bandwidth['buffer_mib']} MiB buffer): read {bandwidth['read_gb_s']:.1f} GB/s, "
            f"copy {bandwidth['copy_gb_s']:.1f} GB/s (read + write counted); the floor uses the read")


def render_rows(name: str, dtype: str, rows: list[dict]) -> str:
    lines = [f"{name} ({dtype}): one decode step; MB read = weights + KV + lm_head + embedding rows",
             f"{'seqs':>4} {'ctx':>5} {'GFLOP':>7} {'MB read':>8} {'weights':>8} {'KV':>6} {'lm_head':>8} "
             f"{'experts/layer':>14} {'step ms':>8} {'fwd ms':>7} {'floor ms':>9} {'peak ms':>8} "
             f"{'of BW floor':>11} {'of GEMM peak':>12} {'bound':>8}  goal"]
    for r in rows:
        c = r["cost"]
        experts = (f"{r['experts_hit']:.1f} ({r['experts_expected']:.1f})" if r["experts_hit"] is not None
                   else "-")
        goal = "" if not r["goal"] else f"{r['goal']} >= {GOAL_FRACTION:.0%}: {'met' if r['goal_met'] else 'SHORT'}"
        lines.append(f"{r['seqs']:>4} {r['ctx_len']:>5.0f} {r['gflop']:>7.2f} {r['mb']:>8.1f} "
                     f"{c['weight_bytes'] / 1e6:>8.1f} {c['kv_bytes'] / 1e6:>6.1f} {c['lm_head_bytes'] / 1e6:>8.1f} "
                     f"{experts:>14} {r['step_ms']:>8.2f} {r['forward_ms']:>7.2f} {r['floor_ms']:>9.2f} "
                     f"{r['compute_ms']:>8.2f} {r['bandwidth_fraction']:>11.1%} {r['gemm_fraction']:>12.1%} "
                     f"{r['bound']:>8}  {goal}")
    if any(r["experts_hit"] is not None for r in rows):
        lines.append("experts/layer: distinct experts read per MoE layer, counted from the routing "
                     "(in parentheses: the uniform-routing expectation)")
    return "\n".join(lines)


def render_profile(name: str, row: dict, profile: dict) -> str:
    goal = f"{row['goal']} goal {'met' if row['goal_met'] else 'short'}" if row["goal"] else "no goal"
    lines = [f"{name} at {row['seqs']} seqs: {goal}; "
             f"step {row['step_ms']:.2f} ms = forward and lm_head {row['forward_ms']:.2f} + outside "
             f"{row['step_ms'] - row['forward_ms']:.2f} (bandwidth floor {row['floor_ms']:.2f}, GEMM peak "
             f"{row['compute_ms']:.2f} ms); top ops by self CPU time over {profile['steps']} steps "
             f"profiled ({profile['step_ms']:.2f} ms each under the profiler):",
             f"  {'op':<44} {'calls/step':>10} {'ms/step':>8} {'share':>6}"]
    lines += [f"  {o['op'][:44]:<44} {o['calls_per_step']:>10.1f} {o['self_ms_per_step']:>8.3f} {o['share']:>6.1%}"
              for o in profile["ops"]]
    return "\n".join(lines)


def run_model(model: Path, seqs: list[int], dtype: str, out_len: int, skip: int, peaks: dict[str, dict],
              bandwidth: dict, profile: str) -> tuple[str, list[dict], dict]:
    """(engine dtype, rows, profiles by seqs) for one model directory."""
    llm = LLM(str(model), max_num_seqs=max(seqs), max_num_batched_tokens=2048, kv_cache_bytes=2 * 2**30,
              dtype=dtype)
    engine_dtype = str(llm.core.runner.dtype).removeprefix("torch.")
    peak = peaks.get(engine_dtype) or gemm_peak(llm.core.runner.dtype)
    decode_steps(llm, 2, min(out_len, 8), 0)  # warm-up
    rows = [measure(llm, n, out_len, skip, peak, bandwidth) for n in seqs]
    profiles = {}
    for r in rows:
        if profile == "always" or (profile == "short" and r["goal"] and not r["goal_met"]):
            profiles[r["seqs"]] = profile_table(llm, r["seqs"], out_len, skip)
    del llm
    return engine_dtype, rows, profiles


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bench-moe,smollm2")
    ap.add_argument("--seqs", default="1,64")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="the engine's dtype (default: auto, what `planaria serve` picks on this host)")
    ap.add_argument("--out-len", type=int, default=64, help="output tokens per sequence (prompt: 128)")
    ap.add_argument("--skip", type=int, default=3, help="decode steps of each batch left untimed")
    ap.add_argument("--profile", default="short", choices=("short", "always", "never"))
    ap.add_argument("--gemm-sizes", default="1024,2048,3072")
    ap.add_argument("--buffer-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    sizes = tuple(int(s) for s in args.gemm_sizes.split(","))
    engine_dtype = choose_dtype(args.dtype, torch.device("cpu"))
    # float32 always, bf16 where the engine runs it (on a host without native bf16 a bf16
    # matmul is emulated: minutes per size, and no engine there runs bf16 by default)
    dtypes = dict.fromkeys((engine_dtype.dtype, torch.float32))
    peaks = {p["dtype"]: p for p in (gemm_peak(d, sizes, args.reps) for d in dtypes)}
    bandwidth = memory_bandwidth(args.buffer_mib * 2**20, args.reps)
    print(render_host(cpu_line(), f"{engine_dtype.name} ({engine_dtype.reason})", torch.get_num_threads(),
                      peaks, bandwidth), flush=True)
    print(f"workload: prompt {PROMPT_LEN} tokens, {args.out_len} out, greedy; the step's median over the "
          f"decode steps of all N sequences, the first {args.skip} left out", flush=True)
    out = dict(host=cpu_line(), threads=torch.get_num_threads(), peaks=peaks, bandwidth=bandwidth, models={})
    for name in args.models.split(","):
        dtype, rows, profiles = run_model(ensure_model(name), seqs, args.dtype, args.out_len, args.skip,
                                          peaks, bandwidth, args.profile)
        print("\n" + render_rows(name, dtype, rows), flush=True)
        for n, prof in profiles.items():
            print("\n" + render_profile(name, next(r for r in rows if r["seqs"] == n), prof), flush=True)
        out["models"][name] = dict(dtype=dtype, rows=rows, profiles={str(k): v for k, v in profiles.items()})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
