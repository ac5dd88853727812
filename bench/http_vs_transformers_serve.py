"""Planaria's HTTP server against ``transformers serve``, same model, same load, one run.

    .venv/bin/python -m bench.http_vs_transformers_serve [--model DIR] [--concurrency 16 32]
        [--requests-per-level-factor 2] [--max-tokens 64] [--prompt-tokens 128] [--only planaria|transformers]

Model: the ``bench-moe`` demo checkpoint (Qwen3-MoE, 111M params, 16 experts top-2, fp32),
built at ``.state/models/bench-moe`` when missing.

Servers, one after the other (never both up at once), each stopped by process group:

- Planaria: ``python -m planaria.frontend.main --model DIR --http 127.0.0.1:P --runtime-dir D
  --engines 1 --spawn-engines --engine-config-json '{"max_num_seqs": 64}'``, up at /ready.
- transformers: ``transformers serve DIR --host 127.0.0.1 --port P --device cpu
  --continuous-batching`` from ``.venv-bench`` (HF_HUB_OFFLINE=1), up at /health.

Load: a closed-loop streaming client (aiohttp, this process): per level C concurrent
streams, ``factor * C`` requests in all, each a distinct text prompt that the model's
tokenizer encodes to exactly ``--prompt-tokens`` tokens (windows of Python stdlib source,
the tokenizer's own training text), ``/v1/completions`` with ``max_tokens``, greedy,
``stream_options.include_usage``. Planaria also gets ``ignore_eos`` (transformers serve
refuses it with 422, so it may stop early at EOS); the tokens counted are each stream's
final ``usage.completion_tokens`` (checked against the SSE chunks). Before the levels each
server gets an untimed warm-up wave (which also makes transformers load the model).

Reported per server and level: output tokens/s (counted tokens / level wall time), TTFT
p50/p99 (send -> first non-empty text chunk), ITL p50/p99 (gaps between successive text
chunks of a stream, pooled), then the Planaria / transformers ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / ".state" / "models" / "bench-moe"
BENCH_VENV = REPO / ".venv-bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _loadavg() -> str:
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# -- prompts ----------------------------------------------------------------------------------

def make_prompts(model_dir: Path, n: int, num_tokens: int, seed: int = 0) -> list[str]:
    """``n`` distinct texts that the model's tokenizer encodes to exactly ``num_tokens``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 20_000)
    rng = random.Random(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(prompts) < n:
        tries += 1
        if tries > 50 * n:
            raise RuntimeError(f"only found {len(prompts)} prompts of exactly {num_tokens} tokens")
        text = rng.choice(files).read_text(errors="replace")
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) < num_tokens * 4:
            continue
        start = rng.randrange(0, len(ids) - num_tokens)
        cand = tok.decode(ids[start:start + num_tokens])
        if cand in seen or len(tok.encode(cand)) != num_tokens:
            continue
        seen.add(cand)
        prompts.append(cand)
    return prompts


# -- servers ----------------------------------------------------------------------------------

class Server:
    name = ""

    def __init__(self, model: Path, log_path: Path) -> None:
        self.model = model
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def command(self) -> tuple[list[str], dict]:
        raise NotImplementedError

    ready_path = "/health"

    def body(self, prompt: str, max_tokens: int) -> dict:
        return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}

    def start(self, timeout_s: float = 600.0) -> float:
        cmd, env = self.command()
        print(f"[{self.name}] $ {' '.join(cmd)}", flush=True)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                                     stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT)
        import urllib.request
        deadline = t0 + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base + self.ready_path, timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not up within {timeout_s} s\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after ``timeout_s``."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # children (engines) may outlive the leader briefly
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(5)
        self.proc = None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class Planaria(Server):
    name = "planaria"
    ready_path = "/ready"

    def __init__(self, model: Path, log_path: Path, engine_config: dict, runtime_prefix: str = "pl-bh-") -> None:
        super().__init__(model, log_path)
        self.engine_config = engine_config
        self.runtime = Path(tempfile.mkdtemp(prefix=runtime_prefix, dir="/tmp"))  # ipc paths stay short

    def command(self):
        cmd = [sys.executable, "-m", "planaria.frontend.main", "--model", str(self.model),
               "--http", f"127.0.0.1:{self.port}", "--runtime-dir", str(self.runtime),
               "--engines", "1", "--spawn-engines", "--log-level", "WARNING",
               "--engine-config-json", json.dumps(self.engine_config)]
        return cmd, self.env()

    @staticmethod
    def env() -> dict[str, str]:
        """Offline, and this checkout's planaria first on the path."""
        return dict(os.environ, HF_HUB_OFFLINE="1",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))

    def body(self, prompt: str, max_tokens: int) -> dict:
        return {**super().body(prompt, max_tokens), "model": self.model.name, "ignore_eos": True}

    def stop(self, timeout_s: float = 30.0) -> None:
        super().stop(timeout_s)
        shutil.rmtree(self.runtime, ignore_errors=True)


class TransformersServe(Server):
    name = "transformers"

    def command(self):
        exe = BENCH_VENV / "bin" / "transformers"
        cmd = [str(exe), "serve", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
               "--device", "cpu", "--continuous-batching"]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1", VIRTUAL_ENV=str(BENCH_VENV),
                   PATH=f"{BENCH_VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
        return cmd, env


def ensure_bench_venv() -> None:
    if (BENCH_VENV / "bin" / "transformers").exists():
        return
    print(f"creating {BENCH_VENV} (torch==2.13.0, transformers[serving]) ...", flush=True)
    subprocess.run(["python3", "-m", "venv", str(BENCH_VENV)], check=True)
    subprocess.run([str(BENCH_VENV / "bin" / "pip"), "install", "-q", "torch==2.13.0",
                    "transformers[serving]"], check=True)


# -- load -------------------------------------------------------------------------------------

async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    chunk_times: list[float] = []
    usage = None
    finish = None
    error = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {(await resp.text())[:300]}"}
            buf = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            continue
                        msg = json.loads(payload)
                        if "error" in msg:
                            error = str(msg["error"])[:300]
                            continue
                        for ch in msg.get("choices") or []:
                            if ch.get("text"):
                                chunk_times.append(now)
                            if ch.get("finish_reason"):
                                finish = ch["finish_reason"]
                        if msg.get("usage"):
                            usage = msg["usage"]
    except Exception as exc:  # noqa: BLE001 - reported as a failed request
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"t0": t0, "chunk_times": chunk_times, "usage": usage, "finish": finish, "error": error,
            "t_end": time.perf_counter()}


async def run_level(server: Server, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    url = server.base + "/v1/completions"
    queue = list(prompts)
    results: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        async def worker():
            while queue:
                prompt = queue.pop(0)
                results.append(await one_request(session, url, server.body(prompt, max_tokens)))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if not r.get("error")]
    errors = [r["error"] for r in results if r.get("error")]
    tokens = [(r["usage"] or {}).get("completion_tokens", len(r["chunk_times"])) for r in ok]
    prompt_tokens = [(r["usage"] or {}).get("prompt_tokens", 0) for r in ok]
    ttft = [r["chunk_times"][0] - r["t0"] for r in ok if r["chunk_times"]]
    itl = [b - a for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]
    chunks = sum(len(r["chunk_times"]) for r in ok)
    return {
        "server": server.name, "concurrency": concurrency, "requests": len(results), "ok": len(ok),
        "errors": errors[:3], "num_errors": len(errors), "wall_s": wall,
        "output_tokens": sum(tokens), "text_chunks": chunks,
        "tokens_min": min(tokens, default=0), "tokens_max": max(tokens, default=0),
        "prompt_tokens_min": min(prompt_tokens, default=0), "prompt_tokens_max": max(prompt_tokens, default=0),
        "finish": {f: sum(r["finish"] == f for r in ok) for f in {r["finish"] for r in ok}},
        "tok_s": sum(tokens) / wall if wall else 0.0,
        "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99),
        "itl_p50": _pct(itl, 0.5), "itl_p99": _pct(itl, 0.99),
    }


def bench_server(server: Server, warmup: list[str], levels: list[tuple[int, list[str]]],
                 max_tokens: int) -> list[dict]:
    up_s = server.start()
    print(f"[{server.name}] up in {up_s:.1f} s; {_loadavg()}", flush=True)
    try:
        t0 = time.perf_counter()
        w = asyncio.run(run_level(server, warmup, len(warmup), 8))
        print(f"[{server.name}] warm-up: {w['ok']}/{w['requests']} ok in {time.perf_counter() - t0:.1f} s"
              + (f"; errors {w['errors']}" if w["num_errors"] else ""), flush=True)
        if w["num_errors"]:
            raise RuntimeError(f"{server.name} warm-up failed: {w['errors']}\n{server.log_tail()}")
        out = []
        for conc, prompts in levels:
            r = asyncio.run(run_level(server, prompts, conc, max_tokens))
            r["loadavg"] = os.getloadavg()
            out.append(r)
            print(f"[{server.name}] c={conc}: {r['ok']}/{r['requests']} ok, {r['output_tokens']} tokens "
                  f"({r['text_chunks']} text chunks, per request {r['tokens_min']}-{r['tokens_max']}, "
                  f"prompt {r['prompt_tokens_min']}-{r['prompt_tokens_max']}, finish {r['finish']}) "
                  f"in {r['wall_s']:.1f} s; {_loadavg()}"
                  + (f"; errors {r['errors']}" if r["num_errors"] else ""), flush=True)
        return out
    finally:
        server.stop()


def print_table(results: dict[str, list[dict]]) -> None:
    hdr = f"{'server':<13}{'conc':>5}{'reqs':>6}{'out tok':>9}{'wall s':>8}{'tok/s':>9}" \
          f"{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
    print(hdr)
    print("-" * len(hdr))
    for name, rows in results.items():
        for r in rows:
            print(f"{name:<13}{r['concurrency']:>5}{r['ok']:>6}{r['output_tokens']:>9}{r['wall_s']:>8.1f}"
                  f"{r['tok_s']:>9.1f}{r['ttft_p50'] * 1e3:>8.0f}ms{r['ttft_p99'] * 1e3:>8.0f}ms"
                  f"{r['itl_p50'] * 1e3:>7.0f}ms{r['itl_p99'] * 1e3:>7.0f}ms")
    pl, tf = results.get("planaria"), results.get("transformers")
    if pl and tf:
        print()
        print("Planaria / transformers serve  (tok/s: higher is better for Planaria; latencies: lower is)")
        for a, b in zip(pl, tf):
            def ratio(k):
                return a[k] / b[k] if b[k] else float("nan")
            print(f"  c={a['concurrency']:<3} tok/s x{ratio('tok_s'):.2f}   TTFT p50 x{ratio('ttft_p50'):.2f}"
                  f"  p99 x{ratio('ttft_p99'):.2f}   ITL p50 x{ratio('itl_p50'):.2f}  p99 x{ratio('itl_p99'):.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http_vs_transformers_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    p.add_argument("--requests-per-level-factor", type=int, default=2,
                   help="requests per level = factor x concurrency (default 2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=4, help="untimed warm-up requests (8 tokens each)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--only", choices=["planaria", "transformers"])
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--log-dir", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)

    t_start = time.perf_counter()
    model = args.model.resolve()
    if not (model / "config.json").exists():
        from planaria.engine.demo_model import build_demo_model
        print(f"building the bench-moe demo model at {model} ...", flush=True)
        build_demo_model(model, preset="bench-moe", progress=lambda m: print("  " + m, flush=True))
    if args.only != "planaria":
        ensure_bench_venv()
    args.log_dir.mkdir(parents=True, exist_ok=True)

    n_levels = sum(c * args.requests_per_level_factor for c in args.concurrency)
    prompts = make_prompts(model, args.warmup + n_levels, args.prompt_tokens)
    warmup, rest = prompts[:args.warmup], prompts[args.warmup:]
    levels = []
    for c in args.concurrency:
        n = c * args.requests_per_level_factor
        levels.append((c, rest[:n]))
        rest = rest[n:]
    print(f"model {model}; {len(prompts)} distinct prompts of {args.prompt_tokens} tokens; "
          f"max_tokens {args.max_tokens}; levels {[(c, len(ps)) for c, ps in levels]}; "
          f"{os.cpu_count()} CPUs; {_loadavg()}", flush=True)

    servers: list[Server] = []
    if args.only != "transformers":
        servers.append(Planaria(model, args.log_dir / "http_bench_planaria.log",
                                {"max_num_seqs": args.max_num_seqs}))
    if args.only != "planaria":
        servers.append(TransformersServe(model, args.log_dir / "http_bench_transformers.log"))
    results: dict[str, list[dict]] = {}
    for s in servers:
        results[s.name] = bench_server(s, warmup, levels, args.max_tokens)

    print()
    print_table(results)
    print(f"\ntotal bench time {time.perf_counter() - t_start:.0f} s; {_loadavg()}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
