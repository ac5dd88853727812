"""Run the supervisor: the OpenAI frontend and N engine cores, kept alive.

    planaria serve --model DIR --engines N --http HOST:PORT [--state-dir D]
                   [--runtime-dir R] [--engine-config-json JSON] [--hang-timeout-s S] ...

Spawns `python -m planaria.frontend.main` and N `python -m planaria.engine.proc` children, restarts them
when they die (backoff, flap hold-off, --retry-limit), kills engines that hang (work
queued, no step progress for --hang-timeout-s) and a frontend whose event loop stops
answering (no liveness beat for --frontend-hang-timeout-s; daemon/frontend_watch.py),
reports every engine death to the frontend at once, serves the admin socket
(RUNTIME_DIR/control.sock) for `planaria status|restart|drain|scale|logs`, and keeps
each child's output in STATE_DIR/logs/.

Under systemd (Type=notify): READY=1 once an engine serves, STATUS= lines, WATCHDOG=1
from the main loop, STOPPING=1 on SIGTERM, RELOADING=1 on SIGHUP (re-reads --env-file
and applies log level, restart policy, hang (engine and frontend) and stop timeouts,
--max-engines live).

Signals: SIGTERM/SIGINT drain (children get SIGTERM, SIGKILL after --stop-timeout-s; a
second signal kills at once); SIGHUP reloads. Exit codes: 0 stopped cleanly; 1 failed
(a child gave up, or another daemon holds the runtime dir); 2 bad configuration (flags,
admin keys, a runtime dir another user owns or others may write to, or every engine
refused by the frontend for its config hash / protocol version; an engine that exits so is
not restarted, see daemon/restart_policy.py). Every socket in the runtime dir is 0600.

HTTP protection: --api-key (or $PLANARIA_API_KEY; handed to the frontend in its
environment, never on a command line), --max-inflight-requests, --request-timeout-s,
--max-body-bytes, --max-connections and the other frontend limits in docs/http_api.md.

Expert parallelism (--parallel ep) without --etcd-endpoints runs an embedded etcd with
auth on (STATE_DIR/etcd/root.password) whose users and roles are audited at every start
(unexpected ones: it refuses to start). With --etcd-listen beyond loopback it is set up on
loopback first and then serves TLS only, from a CA made in STATE_DIR/etcd/tls/: other
nodes join with --etcd-endpoints HOST:PORT --etcd-user root --etcd-password-file (a copy
of root.password) --etcd-ca-cert (a copy of tls/ca.crt). See docs/elastic.md.

Remote admin: --admin-tcp HOST:PORT also serves the admin socket on TCP with CurveZMQ.
The server key pair is made on the first start in --admin-keys-dir (default
STATE_DIR/admin-keys: server.key is the public half clients need); clients are those
whose public key is in its authorized/ directory (`planaria keygen NAME` makes a pair;
at least one is needed to start). Then: `planaria status --connect tcp://HOST:PORT
--server-key server.key --client-key NAME.key_secret`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import zmq

from planaria.daemon import config as config_mod
from planaria.daemon.admin_keys import AdminKeyError, authorized_keys, server_keypair
from planaria.daemon.children import PopenSpawner
from planaria.daemon.commands._common import admin_modules
from planaria.daemon.ep_supervisor import EPSupervisor
from planaria.daemon.errors import DaemonAlreadyRunningError, RuntimeDirError
from planaria.daemon.launch import (frontend_addresses, frontend_liveness_address,
                                    heartbeat_address, log_dir, node_id)
from planaria.daemon.sd_notify import Notifier, watchdog_interval_s

NAME = "serve"
HELP = "run the supervisor daemon (frontend + engine cores)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config_mod.add_serve_arguments(parser)


def main(args: argparse.Namespace) -> int:
    # deferred: every `planaria` command imports this module for its arguments
    # (daemon/cli.py); the supervisor's runtime brings structlog, rich and asyncio
    # (planaria.common.logging), about 60 ms that only `serve` itself should pay
    from planaria.common import logging as plog
    from planaria.daemon.control import ControlServer, ensure_runtime_dir
    from planaria.daemon.loop import SupervisorLoop, command_handler
    from planaria.daemon.supervisor import EXIT_FAILURE, Supervisor
    from planaria.engine.death_reporter import DeathReporter

    cli_flags = config_mod.given_flags(args)
    try:
        config = config_mod.load(cli_flags)
    except config_mod.ConfigError as exc:
        print(f"planaria serve: {exc}", file=sys.stderr)
        return 2
    if not Path(config.model).is_dir():
        print(f"planaria serve: --model {config.model} is not a directory", file=sys.stderr)
        return 2
    interval_s = watchdog_interval_s()  # before the notifier unsets WATCHDOG_USEC
    with contextlib.ExitStack() as cleanup:  # closes what was opened, last first, on every way out
        notifier = Notifier.from_environ(unset_environment=True)
        cleanup.callback(notifier.close)
        plog.configure(level=config.log_level)
        log = plog.get_logger("planaria.serve")
        Path(config.state_dir).mkdir(parents=True, exist_ok=True)
        log_dir(config).mkdir(parents=True, exist_ok=True)
        try:
            ensure_runtime_dir(config.runtime_dir)
        except (RuntimeDirError, OSError) as exc:  # unsafe (others may write there), or not a dir
            print(f"planaria serve: {exc}", file=sys.stderr)
            return 2
        try:
            tcp = _admin_tcp(config, log)
        except (AdminKeyError, OSError) as exc:
            print(f"planaria serve: {exc}", file=sys.stderr)
            return 2

        ctx = zmq.Context()
        cleanup.callback(ctx.term)
        reporter = DeathReporter(ctx, frontend_addresses(config)[1])
        cleanup.callback(reporter.close)
        supervisor = Supervisor(config, PopenSpawner(), time.monotonic, notifier=notifier,
                                report_dead=reporter, report_cause=reporter)
        if config.parallel == "ep":
            try:
                ep_parts = _start_ep(config, supervisor, log)
            except Exception as exc:  # etcd would not start, or the model is not MoE
                print(f"planaria serve: cannot start expert parallelism: {exc}", file=sys.stderr)
                return EXIT_FAILURE
            cleanup.callback(_stop_ep, ep_parts)
        try:
            control = ControlServer(config.runtime_dir, command_handler(supervisor, admin_modules()),
                                    **tcp)
        except (DaemonAlreadyRunningError, zmq.ZMQError) as exc:
            print(f"planaria serve: {exc}" if isinstance(exc, DaemonAlreadyRunningError) else
                  f"planaria serve: cannot bind the admin socket --admin-tcp {config.admin_tcp}: {exc}",
                  file=sys.stderr)
            return EXIT_FAILURE
        cleanup.callback(control.close)
        if control.tcp_endpoint:
            log.info("admin socket on TCP (CurveZMQ)", endpoint=control.tcp_endpoint)
        loop = SupervisorLoop(supervisor, control, heartbeat_address(config),
                              reload_config=lambda: config_mod.reload(supervisor.config, cli_flags),
                              watchdog=notifier.watchdog, watchdog_interval_s=interval_s, ctx=ctx,
                              frontend_liveness_address=frontend_liveness_address(config))
        cleanup.callback(loop.close)
        loop.install_signal_handlers()
        log.info("starting", model=config.model, engines=config.num_engines, http=config.http,
                 state_dir=config.state_dir, runtime_dir=config.runtime_dir,
                 watchdog_interval_s=interval_s)
        code = EXIT_FAILURE
        try:
            code = loop.run()
        except Exception:
            log.exception("supervisor loop failed; killing children")
            supervisor.kill_all()
            for child in supervisor.live_children():
                try:
                    child.popen.wait(10)
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
    log.info("stopped", exit_code=code)
    return code


def _admin_tcp(config, log) -> dict:
    """ControlServer's TCP arguments for --admin-tcp (none without it). The server key
    pair is made on first use; at least one authorized client key must exist."""
    if not config.admin_tcp:
        return {}
    keys_dir = Path(config.admin_keys_dir or Path(config.state_dir) / "admin-keys")
    _public, secret, public_file = server_keypair(keys_dir)
    clients = authorized_keys(keys_dir)
    log.info("admin keys", server_key=str(public_file), authorized=str(clients.directory),
             num_authorized=len(clients.keys()))
    return {"tcp": config.admin_tcp, "curve_secret_key": secret, "curve_client_keys": clients}


def _start_ep(config, supervisor, log):
    """Embedded etcd (unless --etcd-endpoints), this node's lease, record, election and leader
    controller; engines are this supervisor's children, started as EP ranks, as many as the
    leader's placement gives this node (its --engines until there is one).

    The embedded etcd is a supervised child (daemon/etcd_keeper.py: restarted with backoff
    on the same data directory, health-checked, killed with the daemon) with auth on: the
    root credential is made once in STATE_DIR/etcd/root.password (0600) and used by this
    daemon and, through their environment (paths and user only), its engines; its users and
    roles are audited at every start. With --etcd-listen beyond loopback it is set up on
    loopback first and then serves TLS only, with a CA of the daemon's own in
    STATE_DIR/etcd/tls/ (elastic/etcd_bootstrap.py, elastic/etcd_pki.py)."""
    # deferred: only --parallel ep needs them, and planaria.elastic brings torch, grpc and
    # etcd3 (about a second); the etcd keeper brings urllib and http.client
    from planaria.daemon.etcd_keeper import EtcdKeeper
    from planaria.elastic.cluster import EPNode
    from planaria.elastic.etcd_bootstrap import embedded_etcd
    from planaria.elastic.etcd_server import free_port, url_host
    from planaria.engine.models.loader import load_hf_config, spec_from_config

    if not spec_from_config(load_hf_config(config.model)).is_moe:
        raise ValueError(f"--parallel ep needs a mixture-of-experts model; {config.model} is dense")
    keeper = None
    endpoints = config.etcd_endpoints
    security = config.etcd_security()
    if not endpoints:
        host, port = config.etcd_listen_address()
        embedded = embedded_etcd(Path(config.state_dir) / "etcd", host, port,
                                 advertise_host=config.advertise_host)
        security = embedded.security
        keeper = EtcdKeeper(embedded.etcd, password=security.password(), exposed=embedded.exposed).start()
        endpoints = embedded.etcd.endpoint
        log.info("embedded etcd started", endpoint=endpoints, pid=keeper.pid,
                 password_file=security.password_file, tls=embedded.exposed,
                 **({"ca_cert": security.ca_cert} if embedded.exposed else {}))
    supervisor.launcher.etcd_endpoints = endpoints
    supervisor.launcher.etcd_env = security.to_env()  # engines: paths and user via env, never argv
    host = config.advertise_host or "127.0.0.1"
    rendezvous = config.rendezvous or f"{url_host(host)}:{free_port(host)}"
    addresses = {"http": config.http, **({"etcd": endpoints} if keeper is not None else {})}
    node = EPNode(node_id(config), config.cluster, endpoints.split(","), model_dir=config.model,
                  launcher=None, initial_engines=config.num_engines, rendezvous=rendezvous,
                  security=security, host=host, addresses=addresses, place_engines=True,
                  capacity={"engines": config.num_engines, "max_engines": config.max_engines})
    try:
        node.start()
    except Exception:
        if keeper is not None:
            keeper.stop()
        raise
    supervisor.ep = EPSupervisor(node, supervisor.log, etcd=keeper)
    log.info("expert parallelism on", cluster=config.cluster, node=node.node_id, host=host,
             rendezvous=rendezvous, etcd=endpoints)
    return node, keeper


def _stop_ep(parts) -> None:
    node, keeper = parts
    try:
        node.stop()
    finally:
        if keeper is not None:
            keeper.stop()  # the embedded etcd, by pid
