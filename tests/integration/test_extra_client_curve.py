"""`planaria serve --extra-client-addresses tcp://...` with CurveZMQ, for real: the daemon's
engines reach an external EngineClient (the CURVE server, ZAP admitting only the daemon's
engine key) over tcp://127.0.0.1, with the keys the launcher hands them as file paths."""

from __future__ import annotations

import asyncio
import socket

import pytest

from planaria.common.sockets import load_curve_keypair
from planaria.daemon.admin_keys import make_keypair
from planaria.daemon.launch import ENGINE_KEYS_DIR
from planaria.engine.client import EngineClient
from tests.engine._engine_procs import request
from tests.integration.test_supervisor import Daemon, _stop_tree

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_daemon_engines_serve_a_curve_client_over_tcp(tiny_moe, tmp_path):
    server_public_file, server_secret_file = make_keypair(tmp_path / "tool-keys", "tool")
    _public, server_secret = load_curve_keypair(server_secret_file)
    # The engines' pair, as the daemon keeps it in its state dir: made here first, so that
    # the client can authorize it before the daemon starts (the daemon reuses it).
    state = tmp_path / "daemon" / "state"
    engine_public_file, _ = make_keypair(state / ENGINE_KEYS_DIR, "engine")
    engine_public, _ = load_curve_keypair(state / ENGINE_KEYS_DIR / "engine.key_secret")
    address = f"tcp://127.0.0.1:{_free_port()}"

    async def main():
        client = EngineClient(num_engines=2, client_index=1, input_address=address,
                              output_address="tcp://127.0.0.1:*")
        client.use_curve(server_secret, authorized_keys=[engine_public])
        await client.start(wait_ready=False)
        daemon = Daemon(tiny_moe, tmp_path / "daemon", extra_args=(
            "--extra-client-addresses", address, "--extra-client-server-key", str(server_public_file)))
        try:
            await client.wait_for_engines(2, 180)
            for index in (0, 1):
                info = await client.call_utility(index, "get_info")
                assert info["state"] == "running"
            outs = [o async for o in client.generate(request("over-curve", max_tokens=4))]
            assert sum(len(o.new_token_ids) for o in outs) == 4
            # the engines answered the client before the supervisor may have read engine 1's
            # first heartbeat: wait for its count, then check it as before
            status = await asyncio.to_thread(daemon.wait, lambda s: s["num_up"] == 2, 30, "both engines up")
            assert status["num_up"] == 2 and all(e["restarts"] == 0 for e in status["engines"])
            engine_log = (daemon.state / "logs" / "engine-0.log").read_text()
            assert server_secret.decode() not in engine_log
        except BaseException:
            print(daemon.logs())
            raise
        finally:
            await client.close()
            _stop_tree(daemon.proc)
    asyncio.run(main())
    assert engine_public_file.exists()
