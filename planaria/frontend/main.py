"""``python -m planaria.frontend.main``: the OpenAI HTTP server over an EngineClient.

    python -m planaria.frontend.main --model DIR --http 127.0.0.1:8000 --runtime-dir D --engines 2 \\
        [--served-model-name NAME] [--engine-config-json '{"max_model_len": 256}'] [--spawn-engines]

The client binds its ROUTER/PULL sockets under ``--runtime-dir`` (``fe<index>-in`` /
``fe<index>-out``) and its admin socket ``fe<index>-admin`` (frontend/admin.py); engines
(started by the supervisor, or by this process with ``--spawn-engines``) connect there.
HTTP serves at once: /health is 200 from the start, /ready turns 200 when an engine is
running. SIGTERM or SIGINT: /ready goes 503, the listening socket closes, in-flight
requests get ``--drain-timeout-s`` to finish, then the rest are cancelled (which aborts
them in the engines) and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import subprocess
import sys

import msgspec
from aiohttp import web

log = logging.getLogger("frontend")


def parse_http(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--http wants HOST:PORT, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m planaria.frontend.main", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--http", type=parse_http, default=("127.0.0.1", 8000), help="HOST:PORT (default 127.0.0.1:8000)")
    p.add_argument("--runtime-dir", required=True, help="where the engine sockets live")
    p.add_argument("--engines", type=int, default=1, help="engines to expect (and to spawn)")
    p.add_argument("--client-index", type=int, default=0)
    p.add_argument("--served-model-name", help="the model's name in the API (default: the dir's name)")
    p.add_argument("--max-model-len", type=int, help="context limit when no engine reports one")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--engine-config-json", default="{}",
                   help="EngineConfig fields (JSON) for engines that start without a config")
    p.add_argument("--spawn-engines", action="store_true", help="start the engine processes too")
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    p.add_argument("--log-level", default="INFO")
    return p


def _spawn_engines(num_engines: int, input_address: str, config: dict) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-m", "planaria.engine.proc", "--input-addr", input_address,
           "--config-json", msgspec.json.encode(config).decode()]
    return [subprocess.Popen(cmd + ["--engine-index", str(i)]) for i in range(num_engines)]


def _stop_procs(procs: list[subprocess.Popen], timeout_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def serve(args: argparse.Namespace) -> int:
    from planaria.engine.client import EngineClient
    from planaria.frontend.server import create_server

    engine_config = {"model": args.model, **msgspec.json.decode(args.engine_config_json)}
    if args.max_model_len and "max_model_len" not in engine_config:
        engine_config["max_model_len"] = args.max_model_len
    client = EngineClient(args.engines, args.runtime_dir, client_index=args.client_index,
                          engine_config=engine_config)
    server = create_server(client, args.model, args.served_model_name, args.max_model_len, args.max_logprobs)
    await client.start(wait_ready=False)
    from planaria.frontend.admin import AdminSocket, EngineAdmin

    admin_socket = AdminSocket(EngineAdmin(client), args.runtime_dir, args.client_index)
    admin_socket.start()  # planaria load-weights reaches the engines through it
    procs = _spawn_engines(args.engines, client.input_address, engine_config) if args.spawn_engines else []

    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=1.0)
    await runner.setup()
    host, port = args.http
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = runner.addresses[0] if runner.addresses else (host, port)
    print(f"planaria frontend: serving {server.serving.model.name} on http://{bound[0]}:{bound[1]}",
          file=sys.stderr, flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def wait_engines() -> None:
        try:
            await client.wait_for_engines(args.engines, args.ready_timeout_s)
            log.info("%d engine(s) ready", args.engines)
        except Exception as exc:
            log.error("engines not ready: %s", exc)

    waiter = asyncio.create_task(wait_engines())
    await stop.wait()
    log.info("shutting down: draining %d request(s) for up to %.1f s", server.num_in_flight,
             args.drain_timeout_s)
    server.draining = True
    waiter.cancel()
    await site.stop()  # no new connections
    if not await server.wait_idle(args.drain_timeout_s):
        log.warning("%d request(s) still running at the drain timeout; cancelling them", server.num_in_flight)
    await runner.cleanup()  # cancels what is left (which aborts it in the engines)
    await admin_socket.close()
    await client.close()
    if procs:
        await asyncio.to_thread(_stop_procs, procs, args.drain_timeout_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from planaria.common.logging import configure_child  # the daemon's format: JSON lines in its log files

    configure_child(getattr(logging, args.log_level.upper(), logging.INFO), child="frontend",
                    client_index=args.client_index)
    try:
        return asyncio.run(serve(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
