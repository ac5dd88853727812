"""``ServeConfig``: what `planaria serve` runs, from its flags and an env file.

Sources, later wins:

- at start: built-in defaults <- the env file's settings <- the command line's flags;
- on SIGHUP (reload): the running config's flags <- the env file's settings, read again
  (so an edit of the file wins over the flags the unit passed at start).

The env file (``--env-file``, systemd ``EnvironmentFile=`` syntax: ``KEY=value`` lines,
``#`` comments, optional quotes; a missing file sets nothing) is where the unit's options live: ``PLANARIA_ARGS``
holds `planaria serve` flags (split into words and unquoted, as systemd does with the
unit's unbraced ``$PLANARIA_ARGS``: so JSON goes in a file, ``--engine-config-json
@/etc/planaria/engine.json``), ``PLANARIA_LOG_LEVEL`` the log level. Only the settings in
``LIVE_FIELDS`` apply to a running daemon; a changed value of any other field is
reported as needing a restart and otherwise ignored.

Defaults: state dir ``$STATE_DIRECTORY`` or ``./.state``; runtime dir
``$RUNTIME_DIRECTORY`` or ``<state dir>/run``; the API key ``$PLANARIA_API_KEY`` (or the
env file's ``PLANARIA_API_KEY``), which reaches the frontend through its environment,
never its command line. The flags themselves are daemon/serve_flags.py's table.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from planaria.common.tool_parser_names import BUILTIN_TOOL_CALL_PARSERS
from planaria.daemon.errors import DaemonError
# the flags of `planaria serve` (re-exported: commands/serve.py adds them to its parser)
from planaria.daemon.serve_flags import FLAGS, add_serve_arguments, given_flags, serve_parser  # noqa: F401


API_KEY_ENV = "PLANARIA_API_KEY"
ROUTING_POLICIES = ("kv", "least-loaded")  # engine/kv_router.py RoutingPolicy (not imported: engine/ is heavy)
PRIORITY_KEY_ENV = "PLANARIA_PRIORITY_KEY"  # as the API key: from the environment or env file only


class ConfigError(DaemonError):
    """A flag, env file or value that cannot make a ServeConfig."""


class ServeConfig(msgspec.Struct, kw_only=True, frozen=True):
    model: str
    num_engines: int = 1
    max_engines: int = 8
    http: str = "127.0.0.1:8000"
    state_dir: str = ".state"
    runtime_dir: str = ""
    env_file: str | None = None
    engine_config: dict[str, Any] = {}
    compile: bool = False  # EngineConfig.compile for every engine (engine/compiled.py)
    # EngineConfig.batch_invariant for every engine: "on", "off" or "auto" (None there;
    # engine/batch_invariance.py)
    batch_invariant: str = "auto"
    hang_timeout_s: float = 30.0
    stopped_timeout_s: float = 0.3  # an engine stopped (SIGSTOP/SIGTSTP) this long is killed; 0: off
    # the frontend's event loop silent this long (after its first beat) is killed; 0: off
    frontend_hang_timeout_s: float = 10.0
    heartbeat_interval_s: float = 0.5
    stop_timeout_s: float = 30.0  # SIGTERM, then this long to drain, then SIGKILL
    handshake_timeout_s: float = 120.0
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    flap_window_s: float = 60.0
    flap_max_exits: int = 5
    flap_hold_s: float = 300.0
    retry_limit: int | None = None
    stable_s: float = 10.0
    served_restart_delay_s: float = 0.1  # an engine that died after serving
    served_restart_max: int = 30  # such restarts per flap window, per engine
    log_level: str = "INFO"
    # Expert parallelism (elastic/): "replica" = independent engines; "ep" = one EP group
    # whose membership lives in etcd (embedded under the state dir unless endpoints given).
    parallel: str = "replica"
    etcd_endpoints: str = ""  # comma-separated host:port; empty: start an embedded etcd
    cluster: str = "default"
    node_id: str = ""  # default: the host name
    rendezvous: str = ""  # host:port of this node's TCPStore for EP groups; empty: a free port on the advertise host
    # Multi-host EP: this node's routable address (node record, rendezvous store, gloo's
    # binding); empty: 127.0.0.1, a one-host cluster. The embedded etcd listens on
    # etcd_listen (HOST or HOST:PORT) so that other nodes can join it with --etcd-endpoints.
    advertise_host: str = ""
    etcd_listen: str = ""
    # EP: warm standby engine processes kept per node (daemon/standby_pool.py); 0: none.
    num_standby: int = 1
    # A secured etcd cluster (--etcd-endpoints): TLS files, user and password file. The
    # engines get them through their environment (paths and user name only).
    etcd_ca_cert: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    etcd_user: str = ""
    etcd_password_file: str = ""
    # Further ZMQ clients every engine handshakes with besides the frontend (comma-separated
    # ROUTER addresses): a second frontend, or a tool making utility calls (a chaos test's
    # fault injection). An engine waits for each of them at start.
    extra_client_addresses: str = ""
    # CurveZMQ on tcp:// extra clients: the clients' public key file(s) (one for all, or one
    # per tcp:// address in order); engines get a key pair of the daemon's (launch.py).
    # Plain TCP to them only with allow_insecure_tcp_clients.
    extra_client_server_key: str = ""
    allow_insecure_tcp_clients: bool = False
    # Remote admin: a TCP control socket with CurveZMQ (daemon/admin_keys.py).
    admin_tcp: str = ""  # HOST:PORT; empty: only the ipc control socket
    admin_keys_dir: str = ""  # default STATE_DIR/admin-keys
    # The frontend's HTTP limits and API key (frontend/limits.py ServerLimits; docs/http_api.md).
    max_body_bytes: int = 4 * 2**20
    body_read_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 75.0
    max_connections: int = 1024
    max_connections_per_client: int = 64  # 0: no per-address cap (behind a proxy every client is the proxy)
    header_read_timeout_s: float = 10.0  # 0: off
    max_inflight_requests: int = 0  # 0: 4 x max_num_seqs x engines
    request_timeout_s: float = 600.0
    write_timeout_s: float = 30.0
    engine_wait_s: float = 30.0
    render_timeout_s: float = 20.0
    api_key: str = ""  # empty: no key; passed to the frontend as PLANARIA_API_KEY
    api_key_protects_metrics: bool = False
    allow_client_priority: bool = False  # frontend/admission.py
    priority_key: str = ""  # callers presenting it as bearer token may set priority; PLANARIA_PRIORITY_KEY
    tool_call_parser: str = "hermes"  # frontend/tool_parsers.py; "none": tool_choice "auto" is off
    routing: str = "kv"  # or "least-loaded": how the frontend picks a request's engine (engine/kv_router.py)
    # Each engine's KV cache in a shared-memory file (daemon/kv_segments.py) that outlives the
    # process: a survivor adopts a dead or draining engine's blocks. ``--kv-salvage on|off``.
    kv_salvage: bool = True
    kv_segment_ttl_s: float = 20.0  # how long a dead or exited engine's segment is kept

    def validate(self) -> None:
        if self.parallel not in ("replica", "ep"):
            raise ConfigError(f"--parallel must be 'replica' or 'ep', got {self.parallel!r}")
        if self.batch_invariant not in ("on", "off", "auto"):
            raise ConfigError(f"--batch-invariant must be on, off or auto, got {self.batch_invariant!r}")
        if self.num_engines < 1:
            raise ConfigError(f"--engines must be >= 1, got {self.num_engines}")
        if not (0 < self.kv_segment_ttl_s < float("inf")):  # NaN fails too
            raise ConfigError(f"--kv-segment-ttl must be a number of seconds > 0, got {self.kv_segment_ttl_s}")
        if self.max_engines < self.num_engines:
            raise ConfigError(f"--max-engines ({self.max_engines}) must be >= --engines "
                              f"({self.num_engines})")
        host, sep, port = self.http.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"--http wants HOST:PORT, got {self.http!r}")
        for name in ("hang_timeout_s", "heartbeat_interval_s", "stop_timeout_s",
                     "handshake_timeout_s", "body_read_timeout_s", "keep_alive_timeout_s",
                     "request_timeout_s", "write_timeout_s", "render_timeout_s", "max_body_bytes", "max_connections",
                     "engine_wait_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_connections_per_client", "header_read_timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        for address in self.extra_client_list():
            if not address.startswith(("ipc://", "tcp://")):
                raise ConfigError(f"--extra-client-addresses: {address!r} is not an "
                                  "ipc:// or tcp:// address")
        self.extra_client_server_keys()  # raises on TCP without CurveZMQ keys
        if self.admin_tcp:
            host, sep, port = self.admin_tcp.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(f"--admin-tcp wants HOST:PORT, got {self.admin_tcp!r}")
        if self.stopped_timeout_s < 0:
            raise ConfigError(f"--stopped-timeout-s must be >= 0, got {self.stopped_timeout_s}")
        if self.heartbeat_interval_s * 2 > self.hang_timeout_s:
            raise ConfigError("--hang-timeout-s must be at least twice the heartbeat interval")
        if self.frontend_hang_timeout_s < 0 or 0 < self.frontend_hang_timeout_s < 2 * self.heartbeat_interval_s:
            raise ConfigError(f"--frontend-hang-timeout-s must be 0 (off) or at least twice the heartbeat "
                              f"interval ({self.heartbeat_interval_s:g} s), got {self.frontend_hang_timeout_s:g}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(f"unknown log level {self.log_level!r}")
        self.restart_policy()  # RestartPolicy validates its own numbers
        if self.max_inflight_requests < 0:
            raise ConfigError(f"--max-inflight-requests must be >= 0, got {self.max_inflight_requests}")
        if self.num_standby < 0:
            raise ConfigError(f"--standby must be >= 0, got {self.num_standby}")
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if self.tool_call_parser not in (*BUILTIN_TOOL_CALL_PARSERS, "none"):
            raise ConfigError(f"--tool-call-parser must be one of {', '.join([*BUILTIN_TOOL_CALL_PARSERS, 'none'])}, "
                              f"got {self.tool_call_parser!r}")
        if self.advertise_host:
            _ip(self.advertise_host, "--advertise-host")
        if self.etcd_listen:
            if self.etcd_endpoints:
                raise ConfigError("--etcd-listen is for the embedded etcd; with --etcd-endpoints "
                                  "there is none (give one or the other)")
            self.etcd_listen_address()
        security = self.etcd_security()
        if (security.tls or security.auth) and not self.etcd_endpoints:
            raise ConfigError("--etcd-ca-cert/--etcd-cert/--etcd-key/--etcd-user/--etcd-password-file "
                              "are for an etcd cluster given with --etcd-endpoints (the embedded one "
                              "makes its own: STATE_DIR/etcd/root.password, and STATE_DIR/etcd/tls/ "
                              "beyond loopback)")
        if security.problems():
            raise ConfigError("; ".join(security.problems()))

    def etcd_listen_address(self) -> tuple[str, int | None]:
        """(host, port or None) of --etcd-listen HOST[:PORT] (default: loopback, a free port)."""
        if not self.etcd_listen:
            return "127.0.0.1", None
        text = self.etcd_listen
        if text.startswith("["):  # [v6]:port
            host, _, rest = text[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
        elif text.count(":") == 1:
            host, _, port = text.partition(":")
        else:
            host, port = text, ""
        _ip(host, "--etcd-listen")
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"--etcd-listen wants HOST or HOST:PORT, got {text!r}")
        return host, int(port) if port else None

    def etcd_security(self):
        # deferred: every CLI command imports this module (serve's flags); only serve needs it
        from planaria.elastic.etcd_security import EtcdSecurity

        return EtcdSecurity(ca_cert=self.etcd_ca_cert, cert=self.etcd_cert, key=self.etcd_key,
                            user=self.etcd_user, password_file=self.etcd_password_file)

    def extra_client_list(self) -> list[str]:
        return [a.strip() for a in self.extra_client_addresses.split(",") if a.strip()]

    def extra_client_server_keys(self) -> dict[str, str]:
        """{tcp:// extra client address: its CurveZMQ public key file}; empty when there
        are none (ipc:// clients need none). ConfigError for a TCP client without a key
        (unless --allow-insecure-tcp-clients), a key without a TCP client, or a count
        that matches neither one for all nor one per TCP address."""
        tcp = [a for a in self.extra_client_list() if a.startswith("tcp://")]
        keys = [k.strip() for k in self.extra_client_server_key.split(",") if k.strip()]
        if not keys:
            if tcp and not self.allow_insecure_tcp_clients:
                raise ConfigError(
                    f"--extra-client-addresses {', '.join(tcp)}: a TCP link to a client needs "
                    "CurveZMQ: give --extra-client-server-key FILE (the client's public key, "
                    "`planaria keygen NAME` makes NAME.key), or use ipc://, or accept plain "
                    "TCP (anyone who reaches the port can drive the engines) with "
                    "--allow-insecure-tcp-clients")
            return {}
        if not tcp:
            raise ConfigError("--extra-client-server-key is for tcp:// --extra-client-addresses; "
                              "there are none")
        if len(keys) not in (1, len(tcp)):
            raise ConfigError(f"--extra-client-server-key: {len(keys)} key files for {len(tcp)} "
                              "tcp:// clients (give one for all, or one per address in order)")
        for key in keys:
            if not Path(key).is_file():
                raise ConfigError(f"--extra-client-server-key: {key} is not a file")
        return {address: keys[0] if len(keys) == 1 else keys[i] for i, address in enumerate(tcp)}

    def restart_policy(self):
        # deferred: every CLI command imports this module (serve's flags); they cost it ~8 ms
        from planaria.daemon.restart_policy import RestartPolicy
        from planaria.engine.lifecycle import EXIT_CONFIG_MISMATCH

        # An engine refused for its configuration is refused again as it is: no restart loop.
        fatal = {EXIT_CONFIG_MISMATCH: "configuration error: a frontend refused the engine "
                                       "(config hash or protocol version mismatch, see its log)"}
        try:
            return RestartPolicy(self.restart_backoff_s, self.restart_backoff_max_s, 2.0,
                                 self.flap_window_s, self.flap_max_exits, self.flap_hold_s,
                                 self.retry_limit, stable_s=self.stable_s, fatal_exit_codes=fatal,
                                 served_delay_s=self.served_restart_delay_s,
                                 served_max_restarts=self.served_restart_max)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


def _ip(text: str, flag: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise ConfigError(f"{flag} wants an IP address of this host, got {text!r}") from None


#: fields a reload applies to the running daemon; the rest need a restart
LIVE_FIELDS = frozenset({"log_level", "hang_timeout_s", "stopped_timeout_s", "frontend_hang_timeout_s",
                         "stop_timeout_s", "max_engines",
                         "restart_backoff_s", "restart_backoff_max_s", "flap_window_s",
                         "flap_max_exits", "flap_hold_s", "retry_limit", "stable_s",
                         "served_restart_delay_s", "served_restart_max", "kv_segment_ttl_s"})

def parse_env_file(text: str) -> dict[str, str]:
    """systemd ``EnvironmentFile=`` lines: ``KEY=value``; quotes and ``#`` comments."""
    env: dict[str, str] = {}
    for num, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"env file line {num}: not KEY=value: {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[key] = value
    return env


def env_file_flags(path: str | os.PathLike) -> dict[str, Any]:
    """The fields an env file sets (its PLANARIA_ARGS flags and PLANARIA_LOG_LEVEL)."""
    try:
        env = parse_env_file(Path(path).read_text())
    except FileNotFoundError:
        return {}  # like systemd's EnvironmentFile=-PATH: a missing file sets nothing
    except OSError as exc:
        raise ConfigError(f"cannot read env file {path}: {exc}") from exc
    flags: dict[str, Any] = {}
    if env.get("PLANARIA_ARGS"):
        try:
            # split and unquoted as the unit's unbraced $PLANARIA_ARGS is (shell-like words)
            namespace, extra = serve_parser().parse_known_args(shlex.split(env["PLANARIA_ARGS"]))
        except (argparse.ArgumentError, ValueError) as exc:
            raise ConfigError(f"{path}: PLANARIA_ARGS: {exc}") from exc
        if extra:
            raise ConfigError(f"{path}: PLANARIA_ARGS: unknown arguments {extra}")
        flags.update(given_flags(namespace))
    if env.get("PLANARIA_LOG_LEVEL"):
        flags["log_level"] = env["PLANARIA_LOG_LEVEL"]
    if env.get(API_KEY_ENV) and "api_key" not in flags:
        flags["api_key"] = env[API_KEY_ENV]
    if env.get(PRIORITY_KEY_ENV):
        flags["priority_key"] = env[PRIORITY_KEY_ENV]
    flags.pop("env_file", None)  # the file does not move itself
    return flags


def build(flags: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> ServeConfig:
    """A validated ServeConfig from explicit field values, filling the defaults."""
    env = os.environ if environ is None else environ
    values = dict(flags)
    if "model" not in values:
        raise ConfigError("--model is required (on the command line or in PLANARIA_ARGS)")
    if isinstance(values.get("engine_config"), str):
        text = values["engine_config"]
        if text.startswith("@"):
            try:
                text = Path(text[1:]).read_text()
            except OSError as exc:
                raise ConfigError(f"--engine-config-json {text}: {exc}") from exc
        try:
            values["engine_config"] = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"--engine-config-json is not JSON: {exc}") from exc
        if not isinstance(values["engine_config"], dict):
            raise ConfigError("--engine-config-json must be a JSON object")
    state = values.get("state_dir") or (env.get("STATE_DIRECTORY", "").split(":")[0] or ".state")
    values["state_dir"] = str(Path(state).absolute())
    runtime = values.get("runtime_dir") or env.get("RUNTIME_DIRECTORY", "").split(":")[0] \
        or str(Path(values["state_dir"]) / "run")
    values["runtime_dir"] = str(Path(runtime).absolute())
    values["model"] = str(Path(values["model"]).absolute())
    if values.get("env_file"):
        values["env_file"] = str(Path(values["env_file"]).absolute())
    for name in ("etcd_ca_cert", "etcd_cert", "etcd_key", "etcd_password_file"):
        if values.get(name):  # the engines run in the state dir: paths must not be relative
            values[name] = str(Path(values[name]).absolute())
    values["log_level"] = str(values.get("log_level", "INFO")).upper()
    for flag, field, kind, _help in FLAGS:
        if kind == "onoff" and isinstance(values.get(field), str):
            word = values[field].strip().lower()
            if word not in ("on", "off"):
                raise ConfigError(f"{flag} must be on or off, got {values[field]!r}")
            values[field] = word == "on"
    if values.get("extra_client_server_key"):  # engines run in the state dir: absolute paths
        values["extra_client_server_key"] = ",".join(
            str(Path(k.strip()).absolute()) for k in values["extra_client_server_key"].split(",") if k.strip())
    if not values.get("api_key") and env.get(API_KEY_ENV):
        values["api_key"] = env[API_KEY_ENV]
    if not values.get("priority_key") and env.get(PRIORITY_KEY_ENV):
        values["priority_key"] = env[PRIORITY_KEY_ENV]
    try:
        config = msgspec.convert(values, ServeConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"bad setting: {exc}") from exc
    config.validate()
    return config


def load(cli_flags: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> ServeConfig:
    """At start: defaults <- env file <- command line."""
    file_flags = env_file_flags(cli_flags["env_file"]) if cli_flags.get("env_file") else {}
    return build({**file_flags, **cli_flags}, environ)


def reload(current: ServeConfig, cli_flags: Mapping[str, Any],
           environ: Mapping[str, str] | None = None) -> ServeConfig:
    """On SIGHUP: the start flags <- the env file read again (no file: unchanged)."""
    if not current.env_file:
        return current
    return build({**cli_flags, **env_file_flags(current.env_file)}, environ)


def live_changes(old: ServeConfig, new: ServeConfig) -> tuple[dict[str, Any], list[str]]:
    """(fields that apply live with their new values, names of changed fields that need
    a restart)."""
    live, restart = {}, []
    for field in old.__struct_fields__:
        if getattr(old, field) != getattr(new, field):
            if field in LIVE_FIELDS:
                live[field] = getattr(new, field)
            else:
                restart.append(field)
    return live, restart
