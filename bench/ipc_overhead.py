"""IPC overhead: 1-token requests through the full path versus ``EngineCore`` in-process.

    .venv/bin/python -m bench.ipc_overhead [--model DIR] [--concurrency 1 16] [--requests 400]

Three ways to run the same closed-loop load of 1-token requests (``max_tokens=1``,
``ignore_eos``, distinct prompts of ``--prompt-tokens`` random token ids, greedy) on the
same engine configuration, in one run, one after the other:

- ``in-process``: this process owns an ``EngineCore`` and keeps ``C`` requests in flight
  (add until C are queued, ``step()``, count finished ones). No sockets, no serialization.
- ``zmq``: this process is a frontend (``engine.client.EngineClient``: ROUTER + PULL over
  ipc) and ``python -m planaria.engine.proc`` is the engine core process: msgspec encode/decode,
  the engine's IO threads, the busy loop's polling, the output thread.
- ``http``: ``python -m planaria.frontend.main --spawn-engines`` (the OpenAI server plus one engine
  process); this process posts ``/v1/completions`` over loopback (aiohttp, keep-alive):
  adds HTTP parsing, tokenization, detokenization and JSON on top of ``zmq``.

Reported per path and concurrency: requests/s, mean latency, and the ratio to in-process;
at concurrency 1 the latency difference is the per-request cost of the path.
Default model: the ``tiny-moe`` demo checkpoint (small, so the model's forward does not hide
the IPC cost); ``--model`` takes any checkpoint.
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
import tempfile
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / ".state" / "models" / "tiny-moe"


def prompts_for(n: int, num_tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(num_tokens)] for _ in range(n)]


def _request(rid: str, prompt: list[int]):
    from planaria.engine import SamplingParams
    from planaria.engine.messages import EngineCoreRequest

    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt,
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))


def _row(path: str, conc: int, n: int, wall_s: float, latencies: list[float]) -> dict:
    return {"path": path, "concurrency": conc, "requests": n, "wall_s": wall_s,
            "req_s": n / wall_s, "mean_latency_ms": 1e3 * sum(latencies) / max(1, len(latencies))}


# -- in-process --------------------------------------------------------------------------------

def run_in_process(config: dict, prompts: list[list[int]], conc: int) -> dict:
    from planaria.engine.config import EngineConfig
    from planaria.engine.core import create_engine_core

    core = create_engine_core(EngineConfig(**config))
    try:
        for i, p in enumerate(prompts[:4]):  # warm-up
            core.add_request(_request(f"w{i}", p))
        while core.has_unfinished_requests():
            core.step()
        pending = deque(enumerate(prompts))
        started: dict[str, float] = {}
        latencies: list[float] = []
        t0 = time.perf_counter()
        while pending or core.has_unfinished_requests():
            while pending and len(started) < conc:
                i, p = pending.popleft()
                rid = f"r{conc}-{i}"
                started[rid] = time.perf_counter()
                core.add_request(_request(rid, p))
            outs, _ = core.step()
            now = time.perf_counter()
            for o in outs:
                if o.finished:
                    if o.finish_reason not in ("length", "stop"):
                        raise RuntimeError(f"in-process request {o.request_id} ended {o.finish_reason}: {o.error}")
                    latencies.append(now - started.pop(o.request_id))
        return _row("in-process", conc, len(prompts), time.perf_counter() - t0, latencies)
    finally:
        core.shutdown()


# -- zmq: EngineClient + engine process -----------------------------------------------------

def _stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM the process group we started, SIGKILL what is left."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


async def _zmq(config: dict, levels: list[tuple[int, list[list[int]]]], log_dir: Path) -> list[dict]:
    import msgspec

    from planaria.engine.client import EngineClient

    runtime = Path(tempfile.mkdtemp(prefix="pl-ipc-", dir="/tmp"))
    client = EngineClient(1, runtime)
    await client.start(wait_ready=False)
    cmd = [sys.executable, "-m", "planaria.engine.proc", "--engine-index", "0", "--input-addr", client.input_address,
           "--config-json", msgspec.json.encode(config).decode()]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), start_new_session=True,
                            stdout=open(log_dir / "ipc_bench_engine.log", "wb"), stderr=subprocess.STDOUT)
    try:
        await client.wait_for_engines(1, 600)

        async def one(rid: str, prompt: list[int], latencies: list[float]) -> None:
            t0 = time.perf_counter()
            async for out in client.generate(_request(rid, prompt)):
                if out.finished and out.finish_reason not in ("length", "stop"):
                    raise RuntimeError(f"zmq request {rid} ended {out.finish_reason}: {out.error}")
            latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(one(f"w{i}", p, []) for i, p in enumerate(levels[0][1][:4])))
        rows = []
        for conc, prompts in levels:
            queue = deque(enumerate(prompts))
            latencies: list[float] = []

            async def worker() -> None:
                while queue:
                    i, p = queue.popleft()
                    await one(f"z{conc}-{i}", p, latencies)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(conc)))
            rows.append(_row("zmq", conc, len(prompts), time.perf_counter() - t0, latencies))
        return rows
    finally:
        await client.close()
        _stop(proc)
        shutil.rmtree(runtime, ignore_errors=True)


# -- http: frontend process + engine process ------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _http(model: Path, config: dict, levels: list[tuple[int, list[list[int]]]], log_dir: Path) -> list[dict]:
    import aiohttp

    runtime = Path(tempfile.mkdtemp(prefix="pl-ipc-", dir="/tmp"))
    port = _free_port()
    engine_config = {k: v for k, v in config.items() if k != "model"}
    cmd = [sys.executable, "-m", "planaria.frontend.main", "--model", str(model), "--http", f"127.0.0.1:{port}",
           "--runtime-dir", str(runtime), "--engines", "1", "--spawn-engines", "--log-level", "WARNING",
           "--engine-config-json", json.dumps(engine_config)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), start_new_session=True,
                            stdout=open(log_dir / "ipc_bench_http.log", "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            deadline = time.monotonic() + 600
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"frontend exited with {proc.returncode}; see {log_dir / 'ipc_bench_http.log'}")
                try:
                    async with session.get(base + "/ready") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("frontend not ready within 600 s")
                await asyncio.sleep(0.2)

            async def one(prompt: list[int], latencies: list[float]) -> None:
                body = {"model": model.name, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                        "ignore_eos": True}
                t0 = time.perf_counter()
                async with session.post(base + "/v1/completions", json=body) as r:
                    payload = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {payload}")
                latencies.append(time.perf_counter() - t0)

            await asyncio.gather(*(one(p, []) for p in levels[0][1][:4]))
            rows = []
            for conc, prompts in levels:
                queue = deque(prompts)
                latencies: list[float] = []

                async def worker() -> None:
                    while queue:
                        await one(queue.popleft(), latencies)

                t0 = time.perf_counter()
                await asyncio.gather(*(worker() for _ in range(conc)))
                rows.append(_row("http", conc, len(prompts), time.perf_counter() - t0, latencies))
            return rows
    finally:
        _stop(proc)
        shutil.rmtree(runtime, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ipc_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--preset", default="tiny-moe", help="demo preset to build when --model is missing")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=400, help="requests per path and level")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=1,
                   help="torch threads of the engine in every path (default 1: the other core runs the frontend)")
    p.add_argument("--json", type=Path)
    p.add_argument("--log-dir", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)

    model = args.model.resolve()
    if not (model / "config.json").exists():
        from planaria.engine.demo_model import build_demo_model
        print(f"building the {args.preset} demo model at {model} ...", flush=True)
        build_demo_model(model, preset=args.preset)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    config = {"model": str(model), "max_num_seqs": max(64, max(args.concurrency)), "kv_cache_bytes": 256 * 2**20,
              "max_model_len": 512, "num_threads": args.num_threads}
    levels = [(c, prompts_for(args.requests, args.prompt_tokens, vocab, seed=c)) for c in args.concurrency]
    print(f"model {model}; {args.requests} requests of {args.prompt_tokens} prompt tokens, max_tokens 1, "
          f"per path and level {args.concurrency}; engine threads {args.num_threads}; {os.cpu_count()} CPUs", flush=True)

    rows = [run_in_process(config, prompts, conc) for conc, prompts in levels]
    rows += asyncio.run(_zmq(config, levels, args.log_dir))
    rows += asyncio.run(_http(model, config, levels, args.log_dir))

    base = {r["concurrency"]: r for r in rows if r["path"] == "in-process"}
    print(f"\n{'path':<11}{'conc':>5}{'req/s':>9}{'mean ms':>9}{'vs in-process':>15}{'+ms/request':>13}")
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["path"] != "in-process", r["path"])):
        b = base[r["concurrency"]]
        r["ratio_to_in_process"] = r["req_s"] / b["req_s"]
        r["added_ms_per_request"] = 1e3 / r["req_s"] - 1e3 / b["req_s"]
        print(f"{r['path']:<11}{r['concurrency']:>5}{r['req_s']:>9.1f}{r['mean_latency_ms']:>9.2f}"
              f"{r['ratio_to_in_process']:>14.2f}x{r['added_ms_per_request']:>13.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
