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

Limits and protection (defaults in brackets; docs/http_api.md has the whole list):
``--max-body-bytes`` [4 MiB], ``--body-read-timeout-s`` [30], ``--keep-alive-timeout-s``
[75], ``--max-connections`` [1024], ``--max-connections-per-client`` [64, 0 off],
``--header-read-timeout-s`` [10], ``--max-inflight-requests`` [4 x max_num_seqs x
engines], ``--request-timeout-s`` [600], ``--engine-wait-s`` [30], ``--render-timeout-s`` [20] and
``--render-threads`` [4]. ``--tool-call-parser`` [hermes] reads tool calls out of
``tool_choice: "auto"`` answers (frontend/tool_parsers.py). ``--api-key`` (better: the
environment variable ``PLANARIA_API_KEY``, which ``planaria serve`` uses, so the key is not in ``ps``) makes
every /v1/* route need ``Authorization: Bearer <key>``; ``--api-key-protects-metrics``
extends that to /metrics and /ready. /health is always open. ``--routing`` [kv] picks how
a request finds its engine: the one holding the longest cached prefix of its prompt
(weighed against load), or ``least-loaded`` (engine/kv_router.py, docs/routing.md).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys

import msgspec
from aiohttp import web

from planaria.common.logging import configure_child
from planaria.engine.client import EngineClient
from planaria.engine.config import EngineConfig
from planaria.engine.kv_router import RoutingPolicy
from planaria.frontend import liveness
from planaria.frontend.admin import AdminSocket, EngineAdmin
from planaria.frontend.http_guard import CappedTCPSite
from planaria.frontend.limits import ServerLimits
from planaria.frontend.server import create_server
from planaria.frontend.tool_parsers import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS

log = logging.getLogger("frontend")

API_KEY_ENV = "PLANARIA_API_KEY"
PRIORITY_KEY_ENV = "PLANARIA_PRIORITY_KEY"  # callers presenting it as their bearer token may set priority
# The default in-flight bound: this many requests per engine batch slot. An engine lets
# max_num_seqs run and 4 x max_num_seqs wait (EngineConfig.max_num_waiting), so the
# frontend answers 429 itself before its engines must.
INFLIGHT_PER_SEQ = 4


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
    d = ServerLimits()
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"largest request body; more is a 413 (default {d.max_body_bytes})")
    p.add_argument("--body-read-timeout-s", type=float, default=d.body_read_timeout_s,
                   help=f"a body not read in full this long is a 408 (default {d.body_read_timeout_s:g})")
    p.add_argument("--keep-alive-timeout-s", type=float, default=d.keep_alive_timeout_s,
                   help=f"an idle keep-alive connection is closed after this long (default {d.keep_alive_timeout_s:g})")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help=f"open connections beyond this get a 503 and are closed (default {d.max_connections})")
    p.add_argument("--max-connections-per-client", type=int, default=d.max_connections_per_client,
                   help=f"open connections from one IP address beyond this get a 503 and are closed; 0 is off "
                        f"(set 0 behind a reverse proxy: every client has its address) "
                        f"(default {d.max_connections_per_client})")
    p.add_argument("--header-read-timeout-s", type=float, default=d.header_read_timeout_s,
                   help=f"a request head (request line and headers) not complete this long after the "
                        f"connection's accept, or after its first byte on a kept-alive connection, closes the "
                        f"connection (408 when part of it came); 0 is off (default {d.header_read_timeout_s:g})")
    p.add_argument("--max-inflight-requests", type=int, default=0,
                   help=f"sequences in flight (each request counts one per engine request: prompts x n, "
                        f"embedding inputs) beyond this get a 429 with Retry-After "
                        f"(default 0: {INFLIGHT_PER_SEQ} x the engines' max_num_seqs x --engines)")
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                   help=f"a request running longer is aborted: 504, or an SSE error event "
                        f"(default {d.request_timeout_s:g})")
    p.add_argument("--write-timeout-s", type=float, default=d.write_timeout_s,
                   help="a streaming client that takes no data this long (stopped reading) is cut off, its "
                        f"request aborted and its slot freed (default {d.write_timeout_s:g})")
    p.add_argument("--render-timeout-s", type=float, default=d.render_timeout_s,
                   help=f"time limit of chat-template rendering and tokenizing, queueing included; "
                        f"503 render_timeout past it (default {d.render_timeout_s:g})")
    p.add_argument("--engine-wait-s", type=float, default=d.engine_wait_s,
                   help=f"a request that finds no engine serving (restarting), or whose engine died, "
                        f"waits this long for one before a 503 (default {d.engine_wait_s:g})")
    p.add_argument("--render-threads", type=int, default=d.render_threads,
                   help=f"threads rendering and tokenizing prompts (default {d.render_threads})")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; "
                        "prefer the variable: a flag shows in ps)")
    p.add_argument("--api-key-protects-metrics", action="store_true",
                   help="with an API key: /metrics and /ready need it too (default: they are open)")
    p.add_argument("--allow-client-priority", action="store_true",
                   help=f"let every caller set a request's priority (default: only callers whose bearer "
                        f"token is ${PRIORITY_KEY_ENV}; others get 400)")
    p.add_argument("--tool-call-parser", default=DEFAULT_TOOL_CALL_PARSER, choices=[*TOOL_CALL_PARSERS, "none"],
                   help=f"how tool calls are read from tool_choice \"auto\" answers; none: \"auto\" is off "
                        f"(default {DEFAULT_TOOL_CALL_PARSER})")
    p.add_argument("--routing", default=RoutingPolicy.KV.value, choices=[r.value for r in RoutingPolicy],
                   help="how a request picks its engine: kv (the engine holding the longest cached prefix of "
                        "its prompt, weighed against load) or least-loaded (default kv; docs/routing.md)")
    p.add_argument("--liveness-address", default=None,
                   help="ZMQ address the event loop sends its liveness beats to (the supervisor's; "
                        "frontend/liveness.py)")
    p.add_argument("--liveness-interval-s", type=float, default=0.5, help="liveness beat period (default 0.5)")
    return p


def server_limits(args: argparse.Namespace, environ=os.environ) -> ServerLimits:
    inflight = args.max_inflight_requests
    if inflight <= 0:
        engine_config = msgspec.json.decode(args.engine_config_json)
        max_num_seqs = engine_config.get("max_num_seqs") or _default_max_num_seqs()
        inflight = INFLIGHT_PER_SEQ * max_num_seqs * max(1, args.engines)
    return ServerLimits(
        max_body_bytes=args.max_body_bytes, body_read_timeout_s=args.body_read_timeout_s,
        keep_alive_timeout_s=args.keep_alive_timeout_s, max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        header_read_timeout_s=args.header_read_timeout_s,
        max_inflight_requests=inflight, request_timeout_s=args.request_timeout_s,
        write_timeout_s=args.write_timeout_s,
        render_timeout_s=args.render_timeout_s, render_threads=args.render_threads,
        engine_wait_s=args.engine_wait_s,
        api_key=args.api_key or environ.get(API_KEY_ENV) or None,
        api_key_protects_metrics=args.api_key_protects_metrics,
        allow_client_priority=args.allow_client_priority, priority_key=environ.get(PRIORITY_KEY_ENV) or None)


def _default_max_num_seqs() -> int:
    return EngineConfig(model="").max_num_seqs


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
    engine_config = {"model": args.model, **msgspec.json.decode(args.engine_config_json)}
    if args.max_model_len and "max_model_len" not in engine_config:
        engine_config["max_model_len"] = args.max_model_len
    client = EngineClient(args.engines, args.runtime_dir, client_index=args.client_index,
                          engine_config=engine_config, routing=args.routing)
    limits = server_limits(args)
    server = create_server(client, args.model, args.served_model_name, args.max_model_len, args.max_logprobs,
                           limits, tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser)
    await client.start(wait_ready=False)
    admin_socket = AdminSocket(EngineAdmin(client), args.runtime_dir, args.client_index)
    admin_socket.start()  # planaria load-weights reaches the engines through it
    procs = _spawn_engines(args.engines, client.input_address, engine_config) if args.spawn_engines else []

    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=1.0, keepalive_timeout=limits.keep_alive_timeout_s)
    await runner.setup()
    host, port = args.http
    site = CappedTCPSite(runner, host, port, reuse_address=True, max_connections=limits.max_connections,
                         max_connections_per_client=limits.max_connections_per_client,
                         header_read_timeout_s=limits.header_read_timeout_s)
    await site.start()
    bound = runner.addresses[0] if runner.addresses else (host, port)
    print(f"planaria frontend: serving {server.serving.model.name} on http://{bound[0]}:{bound[1]}",
          file=sys.stderr, flush=True)

    # from here on the loop runs: its beats tell the supervisor it answers (a frozen loop stops them)
    liveness_tasks = liveness.start(args.liveness_address, args.liveness_interval_s,  # noqa: F841 - held
                                    routing=lambda: liveness.routing_summary(client))
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
    server.serving.renderer.close()
    await client.close()
    if procs:
        await asyncio.to_thread(_stop_procs, procs, args.drain_timeout_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the daemon's format: JSON lines in its log files
    configure_child(getattr(logging, args.log_level.upper(), logging.INFO), child="frontend",
                    client_index=args.client_index)
    try:
        return asyncio.run(serve(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
