"""The flags of `planaria serve`: one table (flag, ServeConfig field, type, help) that makes
the command line's parser, the env file's ``PLANARIA_ARGS`` parser and the list of fields
a command line set (daemon/config.py layers them; ``ServeConfig`` holds the defaults)."""

from __future__ import annotations

import argparse
from typing import Any


# (flag, field, type, help); every flag's default is "not given" (argparse.SUPPRESS), so
# that the sources can be layered; the defaults shown come from ServeConfig.
FLAGS: list[tuple[str, str, Any, str]] = [
    ("--model", "model", str, "Hugging Face model directory (required)"),
    ("--engines", "num_engines", int, "engine-core processes to run (default 1)"),
    ("--max-engines", "max_engines", int, "capacity: most engines `scale` may reach (default 8)"),
    ("--http", "http", str, "HOST:PORT of the OpenAI HTTP server (default 127.0.0.1:8000)"),
    ("--state-dir", "state_dir", str, "logs and state (default $STATE_DIRECTORY or ./.state)"),
    ("--runtime-dir", "runtime_dir", str,
     "sockets (0600); made 0700 if missing, refused if another user owns it or others may "
     "write to it (default $RUNTIME_DIRECTORY or STATE_DIR/run)"),
    ("--env-file", "env_file", str,
     "env file with PLANARIA_ARGS / PLANARIA_LOG_LEVEL, re-read on SIGHUP"),
    ("--engine-config-json", "engine_config", "json",
     "EngineConfig fields as JSON, or @FILE holding it, e.g. '{\"max_model_len\": 256}'"),
    ("--compile", "compile", bool,
     "compile each engine's decode forward with torch.compile at start (tens of seconds the "
     "first time; the code is cached in STATE_DIR/compile-cache for restarts and standbys)"),
    ("--batch-invariant", "batch_invariant", str,
     "on: every kernel gives a token the same bits whatever its batch-mates and whether it was "
     "prefilled or decoded, so a request replays bit for bit (needs the C++ CPU kernels; no "
     "--compile); off: the fastest kernel per batch size; auto (default): on where its kernels "
     "are as fast, AVX-512 CPUs without AMX (docs/performance.md, \"Batch invariance\")"),
    ("--kv-salvage", "kv_salvage", "onoff",
     "on (default): keep each engine's KV cache in a shared-memory segment that outlives the "
     "process, so a survivor on this node adopts a dead or draining engine's KV blocks instead "
     "of recomputing them (RUNTIME_DIR/kv on a tmpfs, else /dev/shm/planaria-UID-HASH); off: "
     "private memory"),
    ("--kv-segment-ttl", "kv_segment_ttl_s", float,
     "seconds a dead or exited engine's KV segment is kept for a survivor to copy from, then "
     "removed (default 20)"),
    ("--hang-timeout-s", "hang_timeout_s", float,
     "kill an engine with work and no step progress this long (default 30)"),
    ("--stopped-timeout-s", "stopped_timeout_s", float,
     "kill an engine found stopped (SIGSTOP/SIGTSTP, not a debugger's stop) this long, without "
     "waiting for the hang timeout; 0 turns it off (default 0.3)"),
    ("--frontend-hang-timeout-s", "frontend_hang_timeout_s", float,
     "kill (and restart, engines with it) a frontend whose event loop has not answered the "
     "supervisor this long, e.g. frozen in a CPU-bound handler or a deadlock; start-up has "
     "--handshake-timeout-s until the first answer; 0 turns it off (default 10)"),
    ("--heartbeat-interval-s", "heartbeat_interval_s", float,
     "engine heartbeat and frontend liveness beat period (default 0.5)"),
    ("--stop-timeout-s", "stop_timeout_s", float,
     "drain time after SIGTERM before SIGKILL, for stop/restart/drain (default 30)"),
    ("--handshake-timeout-s", "handshake_timeout_s", float,
     "an engine that cannot reach the frontend this long exits (default 120)"),
    ("--restart-backoff-s", "restart_backoff_s", float, "first restart delay, doubling (default 1)"),
    ("--restart-backoff-max-s", "restart_backoff_max_s", float, "longest restart delay (default 60)"),
    ("--flap-window-s", "flap_window_s", float, "flap window (default 60)"),
    ("--flap-max-exits", "flap_max_exits", int, "exits in the window that mean flapping (default 5)"),
    ("--flap-hold-s", "flap_hold_s", float, "hold-off after flapping (default 300)"),
    ("--retry-limit", "retry_limit", int,
     "give up a child after this many failures in a row (default: never)"),
    ("--stable-s", "stable_s", float, "uptime after which a child's backoff resets (default 10)"),
    ("--served-restart-delay-s", "served_restart_delay_s", float,
     "restart delay of an engine that died after serving (no backoff, no flap hold; default 0.1)"),
    ("--served-restart-max", "served_restart_max", int,
     "at most this many such restarts per engine in the flap window (default 30)"),
    ("--log-level", "log_level", str, "DEBUG, INFO, WARNING or ERROR (default INFO)"),
    ("--parallel", "parallel", str,
     "replica (independent engines, default) or ep (experts sharded across the engines)"),
    ("--etcd-endpoints", "etcd_endpoints", str,
     "ep: etcd cluster host:port[,...] (default: an embedded etcd under the state dir)"),
    ("--cluster", "cluster", str, "ep: cluster name, the etcd key prefix /planaria/NAME/ (default: default)"),
    ("--node-id", "node_id", str, "ep: this node's id in the cluster (default: the host name)"),
    ("--rendezvous", "rendezvous", str,
     "ep: HOST:PORT of this node's process-group store (default: a free port on the advertise host)"),
    ("--advertise-host", "advertise_host", str,
     "ep: this node's routable IP for the other nodes: its record, its rendezvous store and the "
     "address gloo binds (default 127.0.0.1: a one-host cluster)"),
    ("--standby", "num_standby", int,
     "ep: warm standby engine processes to keep (imports done, no model state), taken by a "
     "scale-up or a restart instead of a cold start (default 1; 0: none)"),
    ("--etcd-listen", "etcd_listen", str,
     "ep: IP[:PORT] the embedded etcd serves clients on, for the other nodes' --etcd-endpoints "
     "(default 127.0.0.1 and a free port). Auth is always on (STATE_DIR/etcd/root.password); "
     "beyond loopback etcd is set up on loopback first, then serves TLS only, with a CA made in "
     "STATE_DIR/etcd/tls/ (the other nodes pass --etcd-ca-cert with a copy of its ca.crt)"),
    ("--etcd-ca-cert", "etcd_ca_cert", str, "ep: PEM file of the CA of etcd's TLS certificate (TLS on)"),
    ("--etcd-cert", "etcd_cert", str, "ep: client certificate for etcd (with --etcd-key; TLS on)"),
    ("--etcd-key", "etcd_key", str, "ep: the client certificate's key file"),
    ("--etcd-user", "etcd_user", str, "ep: etcd user (auth enabled; with --etcd-password-file)"),
    ("--etcd-password-file", "etcd_password_file", str,
     "ep: file holding the etcd user's password (never given on the command line)"),
    ("--extra-client-addresses", "extra_client_addresses", str,
     "ADDR[,ADDR]: ZMQ clients (ROUTER addresses) every engine also handshakes with, e.g. "
     "a second frontend or a tool making utility calls; an engine waits for each at start"),
    ("--extra-client-server-key", "extra_client_server_key", str,
     "FILE[,FILE]: public key (NAME.key) of the tcp:// extra clients, which serve CurveZMQ; "
     "engines connect with the daemon's key pair STATE_DIR/extra-client-keys/engine.key_secret "
     "(made on first use; its engine.key is what a client may authorize)"),
    ("--allow-insecure-tcp-clients", "allow_insecure_tcp_clients", bool,
     "let tcp:// --extra-client-addresses go without CurveZMQ (plain, unauthenticated TCP)"),
    ("--admin-tcp", "admin_tcp", str,
     "HOST:PORT: also serve the admin socket on TCP with CurveZMQ (keys: --admin-keys-dir)"),
    ("--admin-keys-dir", "admin_keys_dir", str,
     "server key pair (made on first start) and authorized/ client public keys for "
     "--admin-tcp (default STATE_DIR/admin-keys)"),
    ("--max-body-bytes", "max_body_bytes", int, "largest HTTP request body; more is a 413 (default 4194304)"),
    ("--body-read-timeout-s", "body_read_timeout_s", float,
     "a request body not read in full this long is a 408, connection closed (default 30)"),
    ("--keep-alive-timeout-s", "keep_alive_timeout_s", float,
     "an idle HTTP keep-alive connection is closed after this long (default 75)"),
    ("--max-connections", "max_connections", int,
     "open HTTP connections beyond this get a 503 and are closed (default 1024)"),
    ("--max-connections-per-client", "max_connections_per_client", int,
     "open HTTP connections from one client address beyond this get a 503 and are closed; 0: no cap "
     "(set it 0, or high, behind a reverse proxy) (default 64)"),
    ("--header-read-timeout-s", "header_read_timeout_s", float,
     "a connection whose request head is not complete this long after it opened (or after the "
     "next head's first byte) is closed, 408 if part of a head came; 0: off (default 10)"),
    ("--max-inflight-requests", "max_inflight_requests", int,
     "sequences in flight (one per engine request: prompts x n, embedding inputs) beyond this "
     "get a 429 with Retry-After "
     "(default 0: 4 x max_num_seqs x engines)"),
    ("--request-timeout-s", "request_timeout_s", float,
     "a request running longer is aborted in its engine: 504, or an SSE error event (default 600)"),
    ("--write-timeout-s", "write_timeout_s", float,
     "a streaming client that takes no data this long (stopped reading) is cut off, its request "
     "aborted and its slot freed (default 30)"),
    ("--engine-wait-s", "engine_wait_s", float,
     "a request that finds no engine serving, or whose engine died, waits this long for one "
     "before a 503 (default 30)"),
    ("--render-timeout-s", "render_timeout_s", float,
     "time limit of chat-template rendering and tokenizing; past it a 503 (default 20)"),
    ("--api-key", "api_key", str,
     "require 'Authorization: Bearer KEY' on /v1/* (default: $PLANARIA_API_KEY or the env "
     "file's PLANARIA_API_KEY, which keep it out of ps; the frontend gets it in its environment)"),
    ("--api-key-protects-metrics", "api_key_protects_metrics", bool,
     "with an API key: /metrics and /ready need it too (default: they stay open; /health always)"),
    ("--allow-client-priority", "allow_client_priority", bool,
     "let every caller set a request's priority (default: only callers whose bearer token is "
     "$PLANARIA_PRIORITY_KEY, from the environment or the env file; others get 400)"),
    ("--tool-call-parser", "tool_call_parser", str,
     "how the frontend reads tool calls out of tool_choice \"auto\" answers: hermes "
     "(<tool_call>{...}</tool_call>), or none to turn \"auto\" off (default hermes)"),
    ("--routing", "routing", str,
     "how the frontend picks a request's engine: kv (the engine already holding the longest "
     "prefix of its prompt in its KV cache, weighed against load; per tenant with cache_salt) "
     "or least-loaded (default kv; docs/routing.md)"),
]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, field, kind, help_ in FLAGS:
        if kind is bool:  # a switch: present or not
            parser.add_argument(flag, dest=field, action="store_true", default=argparse.SUPPRESS, help=help_)
            continue
        if kind == "onoff":  # on|off, made a bool by build() (a clear error for anything else)
            parser.add_argument(flag, dest=field, type=str, metavar="on|off",
                                default=argparse.SUPPRESS, help=help_)
            continue
        parser.add_argument(flag, dest=field, type=str if kind == "json" else kind,
                            default=argparse.SUPPRESS, help=help_)


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="planaria serve", add_help=False,
                                     exit_on_error=False)
    add_serve_arguments(parser)
    return parser


def given_flags(namespace: argparse.Namespace) -> dict[str, Any]:
    """The ServeConfig fields a parsed command line set explicitly."""
    fields = {field for _flag, field, _kind, _help in FLAGS}
    return {k: v for k, v in vars(namespace).items() if k in fields}
