"""n = 8 sampling against 8 separate requests: prefill work and output tok/s, over HTTP.

    .venv/bin/python -m bench.n_sampling [--model smollm2] [--n 8] [--prompt-tokens 512]
        [--max-tokens 64] [--step-tokens 256] [--trials 3] [--engines 1] [--json FILE]

A real ``planaria serve`` (``--engines``, the shipped daemon: bench/serve_stack.py) on the
real SmolLM2-135M (built into .state/models when missing). Each trial runs, one after
the other on the same warm server, each with a fresh random prompt of ``--prompt-tokens``
token ids (so no run hits another's cache):

- ``n=8``: one /v1/completions request with ``n: 8`` and a seed (one group: the siblings
  share the first one's prefill, engine/prefix_groups.py);
- ``8 requests``: 8 concurrent requests with the same prompt and seeds seed..seed+7 (the
  same 8 texts), the prefix cache on;

and then, on a second server started with ``enable_prefix_caching: false``, ``8
requests, no prefix cache``: what a server without prefix sharing pays. The prompt is
longer than the step's token budget (``--step-tokens``), so it is prefilled in chunks.

Prefill work is the engine's own counter (``planaria_engine_prefill_tokens`` on /metrics:
prompt tokens run through the model); tok/s is 8 x max_tokens over the wall time of the
whole request (or of all 8). Medians over the trials; the ratios are to ``n=8``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from bench.offline_vs_vllm import cpu_line, ensure_model, vocab_limit
from bench.serve_stack import ServeStack


def prefill_tokens(base: str) -> int:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(int(float(v)) for v in re.findall(r'^planaria_engine_prefill_tokens\{engine="\d+"\} (\S+)$',
                                                  text, re.M))


async def completion(session: aiohttp.ClientSession, base: str, body: dict) -> dict:
    async with session.post(f"{base}/v1/completions", json=body) as r:
        out = await r.json()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {out}")
        return out


async def trial(base: str, mode: str, prompt: list[int], n: int, max_tokens: int, seed: int) -> dict:
    common = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
    before = prefill_tokens(base)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        t0 = time.perf_counter()
        if mode == "n":
            r = await completion(session, base, {**common, "n": n, "seed": seed})
            texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
        else:
            rs = await asyncio.gather(*(completion(session, base, {**common, "seed": seed + j}) for j in range(n)))
            texts = [r["choices"][0]["text"] for r in rs]
        wall_s = time.perf_counter() - t0
    await asyncio.sleep(0.5)  # the engine's last stats ride on its last outputs
    return {"wall_s": wall_s, "prefill_tokens": prefill_tokens(base) - before, "texts": texts,
            "tok_s": n * max_tokens / wall_s}


def run_server(model: Path, engine_config: dict, modes: list[str], prompts: dict, args) -> dict:
    out: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="pl-nbench-") as root:
        stack = ServeStack(root, num_engines=args.engines, hang_timeout_s=60.0, engine_config=engine_config, model=str(model))
        stack.start(timeout_s=300.0)
        try:
            warm = [random.Random(99).randrange(1, 1000) for _ in range(args.prompt_tokens)]
            asyncio.run(trial(stack.base, "sep", warm, 2, 4, 0))  # first-request costs out of the way
            for i in range(args.trials):
                for m in modes:
                    out[m].append(asyncio.run(trial(stack.base, m, prompts[m, i], args.n, args.max_tokens, 1000 * i)))
        finally:
            stack.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--step-tokens", type=int, default=256)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    model = ensure_model(args.model)
    hi = vocab_limit(model)
    prompts = {(m, i): [random.Random(f"{m}{i}").randrange(1, hi) for _ in range(args.prompt_tokens)]
               for m in ("n", "sep") for i in range(args.trials)}
    config = dict(max_model_len=args.prompt_tokens + args.max_tokens + 16, max_num_seqs=max(16, args.n),
                  max_num_batched_tokens=args.step_tokens, kv_cache_bytes=256 * 2**20)
    print(f"# CPU: {cpu_line()}")
    print(f"# model {args.model}, prompt {args.prompt_tokens} tokens, n {args.n}, {args.max_tokens} output tokens "
          f"each, temperature 1, step budget {args.step_tokens} tokens, {args.engines} engine(s), {args.trials} trials, "
          "medians")
    cached = run_server(model, config, ["n", "sep"], prompts, args)
    uncached = run_server(model, {**config, "enable_prefix_caching": False}, ["sep"], prompts, args)
    rows = {"n=8" if args.n == 8 else f"n={args.n}": cached["n"], f"{args.n} requests": cached["sep"],
            f"{args.n} requests, no prefix cache": uncached["sep"]}
    same = all(len(set(t["texts"])) == args.n for t in cached["n"])
    base = rows[next(iter(rows))]
    base_prefill = statistics.median(t["prefill_tokens"] for t in base)
    base_tok_s = statistics.median(t["tok_s"] for t in base)
    print(f"{'mode':34} {'prefill tokens':>15} {'x n':>7} {'out tok/s':>10} {'x n':>7} {'wall s':>8}")
    summary = {}
    for name, ts in rows.items():
        prefill = statistics.median(t["prefill_tokens"] for t in ts)
        tok_s = statistics.median(t["tok_s"] for t in ts)
        wall = statistics.median(t["wall_s"] for t in ts)
        summary[name] = {"prefill_tokens": prefill, "tok_s": tok_s, "wall_s": wall}
        print(f"{name:34} {prefill:15.0f} {prefill / base_prefill:7.2f} {tok_s:10.1f} {tok_s / base_tok_s:7.2f} "
              f"{wall:8.2f}")
    print(f"# every n={args.n} request gave {args.n} different texts: {same}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_line(), "args": vars(args) | {"json": str(args.json)},
                                         "summary": summary, "same_texts": same}, indent=1))


if __name__ == "__main__":
    main()
