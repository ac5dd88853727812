"""CurveZMQ on the engines' TCP links to an extra client, on real sockets over
tcp://127.0.0.1: the client (EngineClient.use_curve) is the CURVE server, engines are
CURVE clients with the keys PLANARIA_ENGINE_CURVE points at (common/sockets.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq

from planaria.common.sockets import (ENGINE_CURVE_ENV, CurveClientKeys, engine_curve_env,
                                     engine_curve_keys, load_curve_keypair, load_curve_public_key)
from planaria.daemon.admin_keys import make_keypair
from planaria.engine.client import EngineClient
from planaria.engine.errors import EngineHandshakeError
from planaria.engine.proc_io import handshake
from tests.engine._engine_procs import REPO, engine_config, request, stop_engine

pytestmark = pytest.mark.timeout(180)
TCP = "tcp://127.0.0.1:*"


class Keys:
    """Three pairs: the client's (CURVE server), the daemon's engine pair, a stranger's."""

    def __init__(self, root: Path) -> None:
        self.server_public_file, self.server_secret_file = make_keypair(root, "tool")
        self.engine_public_file, self.engine_secret_file = make_keypair(root, "engine")
        self.stranger_public_file, self.stranger_secret_file = make_keypair(root, "stranger")
        self.server_public, self.server_secret = load_curve_keypair(self.server_secret_file)
        self.engine_public, self.engine_secret = load_curve_keypair(self.engine_secret_file)
        self.stranger_public, self.stranger_secret = load_curve_keypair(self.stranger_secret_file)

    def engine(self, server_key: bytes | None = None, stranger: bool = False) -> CurveClientKeys:
        public, secret = ((self.stranger_public, self.stranger_secret) if stranger
                          else (self.engine_public, self.engine_secret))
        return CurveClientKeys(server_key or self.server_public, public, secret)


@pytest.fixture
def keys(tmp_path) -> Keys:
    return Keys(tmp_path / "keys")


def _curve_client(keys: Keys, authorize: bool = True) -> EngineClient:
    client = EngineClient(num_engines=1, input_address=TCP, output_address=TCP)
    client.use_curve(keys.server_secret, [keys.engine_public] if authorize else None)
    return client


async def _handshake(address: str, curve: dict | None, timeout_s: float):
    """The engine side's handshake, on its own (sync) context in a thread."""
    def run():
        ctx = zmq.Context()
        try:
            return handshake(ctx, 0, [address], None, timeout_s, curve=curve)
        finally:
            ctx.destroy(linger=0)  # its DEALERs too (a failed handshake leaves them open)
    return await asyncio.to_thread(run)


def test_key_files_reach_the_engine_as_paths_only(keys, tmp_path):
    env = engine_curve_env(keys.engine_secret_file, {"tcp://10.0.0.5:5555": keys.server_public_file})
    text = env[ENGINE_CURVE_ENV]
    assert keys.engine_secret.decode() not in text and keys.server_public.decode() not in text
    assert engine_curve_keys(env) == {"tcp://10.0.0.5:5555": keys.engine()}
    assert engine_curve_keys({}) == {}
    assert load_curve_public_key(keys.server_secret_file) == keys.server_public
    with pytest.raises(ValueError, match="no secret key"):
        load_curve_keypair(keys.server_public_file)
    with pytest.raises(ValueError, match="client_key"):
        engine_curve_keys({ENGINE_CURVE_ENV: "{}"})
    (tmp_path / "junk.key").write_text("not a certificate\n")
    with pytest.raises(ValueError, match="junk.key"):
        load_curve_public_key(tmp_path / "junk.key")


def test_matching_keys_handshake_over_tcp(keys):
    async def main():
        client = _curve_client(keys)
        await client.start(wait_ready=False)
        try:
            links = await _handshake(client.input_address, {client.input_address: keys.engine()}, 20.0)
            assert [link.output_address for link in links] == [client.output_address]
            assert links[0].curve == keys.engine()
            assert [e.index for e in client.engines] == [0]  # its HELLO arrived
        finally:
            await client.close()
    asyncio.run(main())


@pytest.mark.parametrize("case", ["wrong server key", "engine key not authorized", "no CURVE"])
def test_a_bad_key_connects_nothing_and_breaks_nothing(keys, case):
    async def main():
        client = _curve_client(keys)
        await client.start(wait_ready=False)
        try:
            bad = {"wrong server key": {client.input_address: keys.engine(keys.stranger_public)},
                   "engine key not authorized": {client.input_address: keys.engine(stranger=True)},
                   "no CURVE": {}}[case]
            with pytest.raises(EngineHandshakeError, match="no HANDSHAKE_INIT"):
                await _handshake(client.input_address, bad, 2.0)
            assert client.engines == []  # not one message got through
            # the client is unharmed: the right keys still get in
            links = await _handshake(client.input_address, {client.input_address: keys.engine()}, 20.0)
            assert links[0].output_address == client.output_address
        finally:
            await client.close()
    asyncio.run(main())


def test_without_authorized_keys_any_engine_with_the_server_key_gets_in(keys):
    async def main():
        client = _curve_client(keys, authorize=False)
        await client.start(wait_ready=False)
        try:
            links = await _handshake(client.input_address,
                                     {client.input_address: keys.engine(stranger=True)}, 20.0)
            assert links[0].output_address == client.output_address
        finally:
            await client.close()
    asyncio.run(main())


def test_use_curve_comes_before_bind(keys):
    client = EngineClient(num_engines=1, input_address=TCP, output_address=TCP)
    client.bind()
    try:
        with pytest.raises(RuntimeError, match="before bind"):
            client.use_curve(keys.server_secret)
    finally:
        asyncio.run(client.close())


def test_an_engine_process_serves_a_curve_client_over_tcp(keys, tiny_moe, tmp_path):
    """A real engine process, its keys given as PLANARIA_ENGINE_CURVE (paths): HELLO, READY,
    a generation and a utility call, every byte over CURVE on both sockets."""
    async def main():
        client = _curve_client(keys)
        client.engine_config = engine_config(Path(tiny_moe))
        client.bind()
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
                   **engine_curve_env(keys.engine_secret_file,
                                      {client.input_address: keys.server_public_file}))
        cmd = [sys.executable, "-m", "planaria.engine.proc", "--engine-index", "0",
               "--input-addr", client.input_address,
               "--settings-json", msgspec.json.encode({"handshake_timeout_s": 60.0}).decode()]
        assert not any(keys.engine_secret.decode() in arg for arg in cmd)
        with open(tmp_path / "engine.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            await client.start(timeout_s=120)
            outs = [o async for o in client.generate(request("curve", max_tokens=5))]
            assert sum(len(o.new_token_ids) for o in outs) == 5 and outs[-1].finish_reason == "length"
            info = await client.call_utility(0, "get_info")
            assert info["state"] == "running"
            assert client.shutdown_engine(0, drain_timeout_s=0)  # over CURVE too
            await asyncio.to_thread(proc.wait, 30)
        finally:
            stop_engine(proc)
            await client.close()
        return proc
    proc = asyncio.run(main())
    assert proc.returncode == 0, (tmp_path / "engine.log").read_text()[-3000:]
