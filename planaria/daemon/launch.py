"""The command lines of the supervisor's children, built from a ServeConfig.

    frontend:  python -m planaria.frontend.main --model M --http H:P --runtime-dir R --engines N ...
    engine i:  python -m planaria.engine.proc --engine-index i --input-addr ipc://R/fe0-in
                   --config-json '{"model": M, ...}' --settings-json '{"heartbeat_address": ...}'
               (EP: python -m planaria.elastic.ep_proc ... --engine-id NODE-eI --etcd-endpoints ...)
    standby:   python -m planaria.elastic.standby --model M --ready-file R/standby-K.ready (EP; stdin a pipe)

Sockets in the runtime dir: ``fe0-in`` / ``fe0-out`` are the frontend's ROUTER / PULL
(common.sockets.ipc_addresses); ``sv-hb`` is the supervisor's heartbeat PULL, ``sv-fe``
its PULL for the frontend's liveness beats (``--liveness-address``, frontend/liveness.py).
Engines also connect to each ``--extra-client-addresses`` ROUTER (one more
``--input-addr``). Children do not inherit ``NOTIFY_SOCKET`` (the supervisor builds its
Notifier with ``unset_environment=True`` before any spawn), and each child's output is
appended to ``<state dir>/logs/<name>.log``.

A ``tcp://`` extra client is a CurveZMQ server (config.py refuses plain TCP unless told
otherwise): engines and standbys get ``PLANARIA_ENGINE_CURVE`` in their environment, the
paths of the daemon's engine key pair (``<state dir>/extra-client-keys/engine.key_secret``,
0600, made on first use) and of each client's public key (common/sockets.py).

With ``--kv-salvage on`` (the default) engines and standbys (which become engines) get
``PLANARIA_KV_SEGMENT_DIR``, the directory where each keeps its KV cache in a file that
outlives it (daemon/kv_segments.py), once the supervisor has made that directory and set
``Launcher.kv_segment_dir``; the frontend never gets it, nor does any child when salvage is
off (an inherited value is dropped).

The API key (``ServeConfig.api_key``) goes to the frontend alone, as ``PLANARIA_API_KEY``
in its environment (``/proc/PID/environ`` is its user's only, unlike the command line
``ps`` shows); the other children's environment never holds it.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from pathlib import Path
from typing import Any, Mapping

import msgspec

from planaria.common.sockets import engine_curve_env, ipc_addresses
from planaria.daemon.admin_keys import make_keypair
from planaria.daemon.children import ChildSpec
from planaria.daemon.config import API_KEY_ENV, PRIORITY_KEY_ENV, ServeConfig
from planaria.daemon.kv_segments import SEGMENT_DIR_ENV

FRONTEND_KEY = ("frontend",)
ENGINE_KEYS_DIR = "extra-client-keys"  # under the state dir: engine.key, engine.key_secret
HEARTBEAT_SOCKET = "sv-hb"
FRONTEND_LIVENESS_SOCKET = "sv-fe"


def engine_key(engine_id: int) -> tuple[str, int]:
    return ("engine", engine_id)


def log_dir(config: ServeConfig) -> Path:
    return Path(config.state_dir) / "logs"


def standby_key(number: int) -> tuple[str, int]:
    return ("standby", number)


def log_path(config: ServeConfig, key) -> Path:
    name = ("frontend" if key == FRONTEND_KEY else "standby" if key[0] == "standby"
            else f"engine-{key[1]}")
    return log_dir(config) / f"{name}.log"  # standbys share one (a taken one writes to its engine's)


def heartbeat_address(config: ServeConfig) -> str:
    return f"ipc://{Path(config.runtime_dir) / HEARTBEAT_SOCKET}"


def frontend_liveness_address(config: ServeConfig) -> str:
    """Where the frontend's event loop sends its liveness beats (daemon/frontend_watch.py)."""
    return f"ipc://{Path(config.runtime_dir) / FRONTEND_LIVENESS_SOCKET}"


def frontend_addresses(config: ServeConfig) -> tuple[str, str]:
    """The frontend's (ROUTER, PULL) addresses: engines connect to both, the supervisor
    pushes ENGINE_CORE_DEAD to the second."""
    return ipc_addresses(config.runtime_dir, 0)


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def node_id(config: ServeConfig) -> str:
    return config.node_id or socket.gethostname()


def ep_engine_id(config: ServeConfig, engine_id: int) -> str:
    """The cluster-wide id of this node's engine ``engine_id`` (etcd engines/<id>)."""
    return f"{node_id(config)}-e{engine_id}"


class Launcher:
    """Builds ChildSpecs; ``python`` and ``environ`` are injectable for tests."""

    etcd_endpoints = ""  # EP: set by `serve` once the (embedded) etcd is up
    etcd_env: dict[str, str] = {}  # EP: etcd TLS/auth settings for the engines (EtcdSecurity.to_env)
    kv_segment_dir = ""  # the KV segment dir, once the supervisor has made it (daemon/kv_segments.py)

    def __init__(self, config: ServeConfig, python: str = sys.executable,
                 environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.python = python
        self.environ = dict(os.environ if environ is None else environ)

    def _env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in self.environ.items()
               if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS",
                            "LISTEN_PID", API_KEY_ENV, PRIORITY_KEY_ENV, SEGMENT_DIR_ENV)}
        env.setdefault("HF_HUB_OFFLINE", "1")
        # --compile: Inductor's caches in the state dir, shared by restarts and standbys
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(self.config.state_dir).resolve() / "compile-cache"))
        # EP: the node's experts in the compute dtype, mapped by every rank (engine/models/expert_cache.py)
        env.setdefault("PLANARIA_EXPERT_CACHE_DIR", str(Path(self.config.state_dir).resolve() / "expert-cache"))
        # Children import the very tree this supervisor runs from (an editable install
        # may not map the package the same way).
        root = str(Path(__file__).resolve().parents[2])
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
        env.update(extra)
        return env

    def kv_segment_env(self) -> dict[str, str]:
        """``PLANARIA_KV_SEGMENT_DIR`` for an engine or a standby: empty when salvage is off
        or its directory could not be made."""
        if not (self.config.kv_salvage and self.kv_segment_dir):
            return {}
        return {SEGMENT_DIR_ENV: str(self.kv_segment_dir)}

    def engine_config(self, extra: Mapping[str, Any] | None = None, num_engines: int = 1) -> dict[str, Any]:
        """An engine's EngineConfig fields. ``num_threads``, unless configured, divides the
        node's cores among its ``num_engines`` engines (at least one each): two engines
        of torch's default (every core each) on a 2-core host ran 4 threads on 2 cores, and
        the lockstep EP ranks stalled streams for a second or more waiting on each other's
        descheduled threads (bench/scale_cycles.py: the longest stall 1.14 s at rest and
        3.0 s while scaling, 0.28 s and 0.44 s with a core each, 2.5x the requests served)."""
        switches: dict[str, Any] = {"compile": True} if self.config.compile else {}
        if self.config.batch_invariant != "auto":  # auto: the engine decides (engine/batch_invariance.py)
            switches["batch_invariant"] = self.config.batch_invariant == "on"
        cfg = {"model": self.config.model, **switches, **self.config.engine_config, **(extra or {})}
        if "num_threads" not in cfg and not str(cfg.get("device", "cpu")).startswith("cuda"):
            cfg["num_threads"] = max(1, len(os.sched_getaffinity(0)) // max(1, num_engines))
        return cfg

    def drain_timeout_s(self) -> float:
        """The child's own drain budget: a little under the supervisor's SIGKILL deadline."""
        return max(0.0, self.config.stop_timeout_s * 0.8)

    def engine(self, engine_id: int, extra_config: Mapping[str, Any] | None = None,
               num_engines: int = 1) -> ChildSpec:
        """Engine ``engine_id`` of the ``num_engines`` this node runs (their share of its cores)."""
        cfg = self.config
        settings = {"handshake_timeout_s": cfg.handshake_timeout_s,
                    "drain_timeout_s": self.drain_timeout_s(),
                    "heartbeat_address": heartbeat_address(cfg),
                    "heartbeat_interval_s": cfg.heartbeat_interval_s,
                    "flight_record_path": self.flight_record_path(engine_id),
                    "log_level": cfg.log_level}
        argv = [self.python, "-m", "planaria.engine.proc", "--engine-index", str(engine_id),
                "--input-addr", frontend_addresses(cfg)[0],
                *(arg for addr in cfg.extra_client_list() for arg in ("--input-addr", addr)),
                "--config-json", _json(self.engine_config(extra_config, num_engines)),
                "--settings-json", _json(settings)]
        if cfg.parallel == "ep":  # an expert-parallel rank: joins epochs from etcd
            argv[2] = "planaria.elastic.ep_proc"
            argv += ["--engine-id", ep_engine_id(cfg, engine_id), "--node-id", node_id(cfg),
                     "--etcd-endpoints", self.etcd_endpoints or cfg.etcd_endpoints, "--cluster", cfg.cluster]
            if cfg.advertise_host:  # gloo binds the node's routable address
                argv += ["--bind-host", cfg.advertise_host]
        key = engine_key(engine_id)
        etcd_env = self.etcd_env if cfg.parallel == "ep" else {}
        return ChildSpec(key=key, argv=argv, env=self._env(PLANARIA_ENGINE_ID=str(engine_id), **etcd_env,
                                                           **self.curve_env, **self.kv_segment_env()),
                         log_path=str(log_path(cfg, key)), cwd=cfg.state_dir)

    def flight_record_path(self, engine_id: int) -> str:
        """Where engine ``engine_id`` writes its flight record (engine/flight_record.py)."""
        return str(Path(self.config.runtime_dir) / f"engine-{engine_id}.flight")

    @functools.cached_property
    def curve_env(self) -> dict[str, str]:
        """``PLANARIA_ENGINE_CURVE`` for engines and standbys (empty: no tcp:// client has a
        key); the engine key pair is made here, on first use, and kept across restarts so
        that a client can authorize its public half."""
        servers = self.config.extra_client_server_keys()
        if not servers:
            return {}
        keys_dir = Path(self.config.state_dir) / ENGINE_KEYS_DIR
        secret = keys_dir / "engine.key_secret"
        if not secret.exists():
            make_keypair(keys_dir, "engine")
        return engine_curve_env(secret, servers)

    def standby(self, number: int, ready_file: str) -> ChildSpec:
        """A warm standby EP engine process (elastic/standby.py): imports done, waiting for
        its assignment on stdin (daemon/standby_pool.py)."""
        cfg = self.config
        key = standby_key(number)
        argv = [self.python, "-m", "planaria.elastic.standby", "--model", cfg.model, "--ready-file", ready_file]
        return ChildSpec(key=key, argv=argv, env=self._env(**self.etcd_env, **self.curve_env, **self.kv_segment_env()),
                         log_path=str(log_path(cfg, key)),
                         cwd=cfg.state_dir, stdin_pipe=True)

    def frontend(self, num_engines: int) -> ChildSpec:
        cfg = self.config
        argv = [self.python, "-m", "planaria.frontend.main", "--model", cfg.model, "--http", cfg.http,
                "--runtime-dir", cfg.runtime_dir, "--engines", str(num_engines),
                "--engine-config-json", _json(cfg.engine_config),
                "--drain-timeout-s", f"{self.drain_timeout_s():g}",
                "--log-level", cfg.log_level]
        if "max_model_len" in cfg.engine_config:
            argv += ["--max-model-len", str(cfg.engine_config["max_model_len"])]
        argv += ["--max-body-bytes", str(cfg.max_body_bytes),
                 "--body-read-timeout-s", f"{cfg.body_read_timeout_s:g}",
                 "--keep-alive-timeout-s", f"{cfg.keep_alive_timeout_s:g}",
                 "--max-connections", str(cfg.max_connections),
                 "--max-connections-per-client", str(cfg.max_connections_per_client),
                 "--header-read-timeout-s", f"{cfg.header_read_timeout_s:g}",
                 "--max-inflight-requests", str(cfg.max_inflight_requests),
                 "--request-timeout-s", f"{cfg.request_timeout_s:g}",
                 "--write-timeout-s", f"{cfg.write_timeout_s:g}",
                 "--render-timeout-s", f"{cfg.render_timeout_s:g}",
                 "--engine-wait-s", f"{cfg.engine_wait_s:g}",
                 "--tool-call-parser", cfg.tool_call_parser,
                 "--routing", cfg.routing,
                 "--liveness-address", frontend_liveness_address(cfg),
                 "--liveness-interval-s", f"{cfg.heartbeat_interval_s:g}"]
        if cfg.api_key_protects_metrics:
            argv.append("--api-key-protects-metrics")
        if cfg.allow_client_priority:
            argv.append("--allow-client-priority")
        secret = {API_KEY_ENV: cfg.api_key} if cfg.api_key else {}
        if cfg.priority_key:
            secret[PRIORITY_KEY_ENV] = cfg.priority_key
        return ChildSpec(key=FRONTEND_KEY, argv=argv, env=self._env(**secret),
                         log_path=str(log_path(cfg, FRONTEND_KEY)), cwd=cfg.state_dir)
