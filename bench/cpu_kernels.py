"""The C++ CPU kernels against the torch code they replace, on this host, at the shapes of
the two benchmark models (SmolLM2-135M and bench-moe).

    .venv/bin/python -m bench.cpu_kernels [--dtype float32,bfloat16] [--reps 30] [--ops linear,lm_head,moe,attention]
        [--json FILE]

Rows (median milliseconds of ``--reps`` calls after a warm-up, each op alone):
- linear: ``torch.ops.planaria.skinny_linear`` vs ``F.linear`` (torch's GEMM) at 1-64 rows
  on SmolLM2's q/k/v/o, gate/up, down and bench-moe's dense shapes. kernels/linear.py
  takes the C++ kernel up to ``max_rows(dtype)`` rows on this host, printed;
- lm_head + greedy argmax: ``linear_argmax`` (a vocab chunk at a time, the argmax taken
  while the chunk is in cache) vs ``F.linear`` then ``argmax_rows``, and ``F.linear``
  alone, so the argmax's own cost shows (SmolLM2's 49152 x 576 head); in bfloat16 where
  oneDNN packs weights (the engine's lm_head there), also the packed head: whole (the GEMM
  alone, then with ``argmax_rows``) against its chunks (engine/models/packing.py
  ``pack_lm_head``): ``packed_linear_argmax`` and the logits ``packed_linear_chunked``,
  timed in turn call by call (``--reps`` rounds), as the differences are a few percent;
- fused MoE: ``torch.ops.planaria.fused_moe`` vs the torch code (bench-moe's 16 experts,
  top-2, 512 -> 512, routed at random) at 1-64 tokens;
- decode attention: ``torch.ops.planaria.decode_attention`` vs the torch code
  (kernels/attention.py with the kernels off: gather the blocks, SDPA) at SmolLM2's heads
  (9 query / 3 KV, 64 values) and bench-moe's (8 / 4), 1-64 sequences of 162 tokens in
  16-token blocks scattered over the cache, each call on the next of 8 layers' caches (as
  a step reads them: not from the CPU's cache at 64 sequences); the KV bytes read per
  second (keys and values).
The host line (CPU model, AVX-512 / AVX2 flags) is printed; ratios are same-run.
(Not named bench/kernels.py: vLLM imports a package named ``kernels``, and its offline
script, bench/_vllm_offline.py, runs with bench/ first on sys.path.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.offline_vs_vllm import cpu_line
from planaria.kernels import cpu_ext
from planaria.kernels.attention import build_metadata, paged_attention
from planaria.kernels import linear as lin
from planaria.kernels.moe import grouped_expert_mlp
from planaria.kernels.sampling import argmax_rows


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def linears(dtype: torch.dtype, reps: int) -> list[dict]:
    shapes = {"smollm2 qkv 576->960": (960, 576), "smollm2 gate_up 576->3072": (3072, 576),
              "smollm2 down 1536->576": (576, 1536), "bench-moe qkv 512->1024": (1024, 512)}
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k).to(dtype)
        for m in (1, 4, 16, 64):
            x = torch.randn(m, k).to(dtype)
            ours = timed(lambda: torch.ops.planaria.skinny_linear(x, w, None), reps)
            ref = timed(lambda: F.linear(x, w), reps)
            rows.append(dict(op="linear", shape=name, rows=m, cpp_ms=round(ours, 4), torch_ms=round(ref, 4),
                             speedup=round(ref / ours, 2)))
            print(f"  linear  {name:<26} {m:>3} rows  C++ {ours:8.4f}  torch {ref:8.4f}  {ref / ours:5.2f}x", flush=True)
    return rows


def lm_head(dtype: torch.dtype, reps: int) -> list[dict]:
    w = torch.randn(49152, 576).to(dtype)
    rows = []
    for m in (16, 32, 64):
        x = torch.randn(m, 576).to(dtype)
        chunk = lin.lm_head_chunk(m, dtype)
        fused = timed(lambda: torch.ops.planaria.linear_argmax(x, w, chunk), reps)
        two = timed(lambda: argmax_rows(F.linear(x, w)), reps)
        alone = timed(lambda: F.linear(x, w), reps)
        rows.append(dict(op="lm_head_argmax", rows=m, fused_ms=round(fused, 4), linear_then_argmax_ms=round(two, 4),
                         linear_alone_ms=round(alone, 4)))
        print(f"  lm_head+argmax {m:>3} rows  fused {fused:7.3f}  linear+argmax {two:7.3f}  linear alone {alone:7.3f}"
              f"  (argmax's cost: fused {fused - alone:+.3f}, separate {two - alone:+.3f})", flush=True)
    return rows


def side_by_side(fns: dict, reps: int) -> dict[str, float]:
    """Median ms of each of ``fns``, called in turn, round after round (drift hits all)."""
    for _ in range(3):
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def lm_head_packed(dtype: torch.dtype, reps: int) -> list[dict]:
    from planaria.engine.models import packing

    if dtype != torch.bfloat16 or not packing.available(torch.device("cpu"), dtype):
        return []
    w = torch.randn(49152, 576).to(dtype)
    whole, chunks = packing.pack(w), packing.pack_lm_head(w)
    size = chunks[0].shape[0]
    rows = []
    for m in (16, 32, 64):
        x = torch.randn(m, 576).to(dtype)
        t = side_by_side({
            "whole": lambda: lin.packed_linear(x, whole),
            "whole_then_argmax": lambda: argmax_rows(lin.packed_linear(x, whole)),
            "chunks_argmax": lambda: torch.ops.planaria.packed_linear_argmax(x, chunks, size),
            "chunks_logits": lambda: torch.ops.planaria.packed_linear_chunked(x, chunks, size, False),
        }, max(reps, 60))
        rows.append(dict(op="packed_lm_head", rows=m, chunk=size, **{f"{k}_ms": round(v, 4) for k, v in t.items()}))
        print(f"  packed lm_head {m:>3} rows  whole {t['whole']:7.3f}  whole+argmax {t['whole_then_argmax']:7.3f}"
              f"  | {len(chunks)} chunks of {size}: argmax {t['chunks_argmax']:7.3f}  logits {t['chunks_logits']:7.3f}",
              flush=True)
    return rows


def moe(dtype: torch.dtype, reps: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    E, H, I, K = 16, 512, 512, 2
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(dtype)
    rows = []
    for t in (1, 4, 16, 64):
        x = torch.randn(t, H, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
        wts = torch.softmax(torch.randn(t, K, generator=g), -1).to(dtype)
        ours = timed(lambda: grouped_expert_mlp(x, w13, w2, wts, ids), reps)
        cpu_ext.enabled = False
        try:
            ref = timed(lambda: grouped_expert_mlp(x, w13, w2, wts, ids), reps)
        finally:
            cpu_ext.enabled = True
        rows.append(dict(op="fused_moe", tokens=t, cpp_ms=round(ours, 4), torch_ms=round(ref, 4),
                         speedup=round(ref / ours, 2)))
        print(f"  fused_moe {t:>3} tokens  C++ {ours:8.4f}  torch {ref:8.4f}  {ref / ours:5.2f}x", flush=True)
    return rows


def attention(dtype: torch.dtype, reps: int, ctx: int = 162, layers: int = 8, block: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for model, (hq, hkv, d) in (("smollm2", (9, 3, 64)), ("bench-moe", (8, 4, 64))):
        for seqs in (1, 16, 64):
            nb = -(-ctx // block)
            slots = seqs * nb * block
            caches = [(torch.randn(slots, hkv, d, generator=g).to(dtype), torch.randn(slots, hkv, d, generator=g).to(dtype))
                      for _ in range(layers)]
            tables = torch.randperm(seqs * nb, generator=g).view(seqs, nb)
            md = build_metadata(tables.numpy(), [ctx] * seqs, [], block, torch.device("cpu"))
            q = torch.randn(seqs, hq, d, generator=g).to(dtype)
            k_new = torch.randn(seqs, hkv, d, generator=g).to(dtype)
            out = torch.empty_like(q)
            turn = itertools.count()
            scale = d ** -0.5

            def ours():
                kc, vc = caches[next(turn) % layers]
                torch.ops.planaria.decode_attention(q, kc, vc, md.decode_blocks, md.decode_ctx_lens, block, scale, out)

            def torch_code():
                kc, vc = caches[next(turn) % layers]
                paged_attention(q, k_new, k_new, kc, vc, md, scale)

            mine = timed(ours, reps)
            cpu_ext.enabled = False
            try:
                ref = timed(torch_code, reps)
            finally:
                cpu_ext.enabled = True
            gbs = 2 * seqs * ctx * hkv * d * q.element_size() / (mine / 1000) / 1e9
            rows.append(dict(op="decode_attention", model=model, seqs=seqs, ctx=ctx, cpp_ms=round(mine, 4),
                             torch_ms=round(ref, 4), speedup=round(ref / mine, 2), kv_gb_s=round(gbs, 1)))
            print(f"  decode_attention {model:<9} {seqs:>3} seqs x {ctx}  C++ {mine:8.4f}  torch {ref:8.4f}  "
                  f"{ref / mine:5.2f}x  KV read {gbs:5.1f} GB/s", flush=True)
    return rows


SECTIONS = {"linear": [linears], "lm_head": [lm_head, lm_head_packed], "moe": [moe], "attention": [attention]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    ap.add_argument("--ops", default="linear,lm_head,moe,attention", help="the sections to run (comma-separated)")
    args = ap.parse_args()
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in SECTIONS]
    if unknown:  # before any section runs
        raise SystemExit(f"--ops: unknown section(s) {', '.join(unknown)} (of {', '.join(SECTIONS)})")
    if not cpu_ext.available():
        raise SystemExit(f"the C++ kernels are not loaded: {cpu_ext.status()}")
    print(f"host: {cpu_line()}; AVX2+FMA {'yes' if {'avx2', 'fma'} <= set(cpu_ext.cpu_flags().split()) else 'no'}, "
          f"AVX-512 {'yes' if 'avx512f' in cpu_ext.cpu_flags().split() else 'no'}; torch threads {torch.get_num_threads()}")
    out = {}
    with torch.inference_mode():
        for name in args.dtype.split(","):
            dtype = getattr(torch, name)
            print(f"{name}: kernels/linear.py takes the C++ linear up to {lin.max_rows(dtype)} rows here")
            out[name] = [row for section in ops for fn in SECTIONS[section] for row in fn(dtype, args.reps)]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
