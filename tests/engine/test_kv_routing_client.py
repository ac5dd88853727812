"""KV-aware routing in engine/client.py: requests go to the engine whose prefix index holds
their prompt's prefix, and an engine's index is dropped the moment it is reported dead,
restarts, drains, or its events come from another process.

First against fake engines written on the wire protocol over real ZMQ sockets (exact
control of the KV events), then against real engine processes (tiny-moe): the frontend's
hashes are the engine's, a follow-up hits the engine's cache, a salted one does not."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from planaria.engine.block_pool import hash_request_blocks
from planaria.engine.client import EngineClient
from planaria.engine.messages import EngineCoreOutput, EngineCoreOutputs, KVCacheEvents
from planaria.engine.wire import (ENGINE_INPUT_TYPES, PROTOCOL_VERSION, EngineStatus, Hello, MsgType, Ready,
                                  WireDecoder, WireEncoder, engine_identity)
from tests.engine._engine_procs import LoopThread, engine_config, request, spawn_engine, stop_engine

pytestmark = pytest.mark.timeout(240)
BLOCK = 16
PROMPT = list(range(100, 260))  # 10 blocks of 16


class FakeEngine:
    """An engine process as the client sees it: a DEALER (HELLO, READY; ADDs in) and a
    PUSH (outputs, KV events, statuses out), with a pid of our choosing."""

    def __init__(self, ctx: zmq.Context, client: EngineClient, index: int, pid: int) -> None:
        self.index, self.pid, self.seq = index, pid, 0
        self.enc, self.dec = WireEncoder(reuse_buffer=False), WireDecoder(ENGINE_INPUT_TYPES)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, engine_identity(index))
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(client.input_address)
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.dealer.send_multipart(self.enc.encode(MsgType.HELLO, Hello(engine_index=index, pid=pid,
                                                                        protocol_version=PROTOCOL_VERSION)))
        assert self.dealer.poll(10_000)
        t, init = self.dec.decode(self.dealer.recv_multipart())
        assert t == MsgType.HANDSHAKE_INIT
        self.push.connect(init.addresses["output"])
        self.dealer.send_multipart(self.enc.encode(MsgType.READY, Ready(
            engine_index=index, num_kv_blocks=64, max_model_len=256, protocol_version=PROTOCOL_VERSION,
            config_hash="h", kv_cache_bytes=1, kv_source="given", pid=pid, block_size=BLOCK)))

    def events(self, stored=(), removed=(), cleared=False, pid=None) -> None:
        self.seq += 1
        self.push.send_multipart(self.enc.encode(MsgType.OUTPUTS, EngineCoreOutputs(
            engine_index=self.index, kv_events=KVCacheEvents(seq=self.seq, pid=pid or self.pid, cleared=cleared,
                                                             stored=list(stored), removed=list(removed)))))

    def status(self, state: str) -> None:
        self.push.send_multipart(self.enc.encode(MsgType.STATUS, EngineStatus(
            engine_index=self.index, state=state, pid=self.pid)))

    def take_add(self, timeout_s: float = 0.5):
        """The request sent here, or None."""
        if not self.dealer.poll(int(timeout_s * 1000)):
            return None
        t, msg = self.dec.decode(self.dealer.recv_multipart())
        assert t == MsgType.ADD
        return msg

    def finish(self, rid: str, num_cached_tokens: int = 0) -> None:
        self.push.send_multipart(self.enc.encode(MsgType.OUTPUTS, EngineCoreOutputs(engine_index=self.index, outputs=[
            EngineCoreOutput(request_id=rid, new_token_ids=[1], finish_reason="length",
                             num_cached_tokens=num_cached_tokens)])))

    def close(self) -> None:
        self.dealer.close(0)
        self.push.close(0)


def _wait(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.01)


@pytest.fixture
def fakes(tmp_path_factory):
    lt = LoopThread()
    client = EngineClient(num_engines=2, runtime_dir=tmp_path_factory.mktemp("kv"), expected_config_hash="h")
    client.bind()
    ctx = zmq.Context()
    engines: list[FakeEngine] = []
    try:
        lt.run(client.start(wait_ready=False))
        engines += [FakeEngine(ctx, client, 0, pid=100), FakeEngine(ctx, client, 1, pid=200)]
        lt.run(client.wait_for_engines(2, 10.0))
        yield lt, client, engines
    finally:
        for e in engines:
            e.close()
        lt.run(client.close())
        ctx.term()
        lt.close()


def _send(lt, client, req, engines: list[FakeEngine]) -> int:
    """Submit ``req``, see which fake engine gets it, finish it there; returns that index."""
    async def run():
        return [o async for o in client.generate(req)]

    fut = asyncio.run_coroutine_threadsafe(run(), lt.loop)
    deadline = time.monotonic() + 10
    while True:
        for e in engines:
            add = e.take_add(0.02)
            if add is not None:
                assert add.request_id == req.request_id
                e.finish(add.request_id)
                fut.result(10)
                return e.index
        assert time.monotonic() < deadline, "no engine got the request"


def salted(req, salt: str):
    return msgspec.structs.replace(req, cache_salt=salt)


def _hashes(prompt, salt=None):
    return hash_request_blocks(prompt, BLOCK, [], salt)


def test_a_request_goes_to_the_engine_holding_its_prefix(fakes):
    lt, client, (e0, e1) = fakes
    e1.events(stored=_hashes(PROMPT)[:8])
    _wait(lambda: client.engines[1].num_cached_blocks == 8, what="engine 1's index")
    for i in range(4):  # load alone would alternate; the prefix keeps them on engine 1
        assert _send(lt, client, request(f"a{i}", prompt=PROMPT + [i]), [e0, e1]) == 1
    assert client.router.decisions["prefix"] == 4
    # another tenant's salt matches nothing: routed on load alone
    _send(lt, client, salted(request("salted", prompt=PROMPT + [9]), "tenant-b"), [e0, e1])
    assert client.router.decisions["no_prefix"] == 1
    status = client.routing_status()
    assert status["engines"]["1"]["num_cached_blocks"] == 8 and status["engines"]["1"]["num_routed"] >= 4


def test_events_of_another_process_of_the_engine_are_ignored(fakes):
    lt, client, (e0, e1) = fakes
    e0.events(stored=_hashes(PROMPT), pid=999)  # not engine 0's process
    e1.events(stored=[1, 2, 3])
    _wait(lambda: client.engines[1].num_cached_blocks == 3, what="engine 1's events")
    assert client.engines[0].num_cached_blocks == 0


@pytest.mark.parametrize("how", ["death report", "restart", "draining", "stopped"])
def test_an_engines_index_is_dropped_at_once(fakes, tmp_path, how):
    lt, client, (e0, e1) = fakes
    e0.events(stored=_hashes(PROMPT))
    _wait(lambda: client.engines[0].num_cached_blocks == 10, what="engine 0's index")
    if how == "death report":  # what the supervisor sends for a SIGKILLed engine
        lt.run(_call(client.mark_engine_dead, 0, "killed", 100))
    elif how == "restart":  # a new process says HELLO before any death report (the old one's socket lingers)
        fakes[2].append(FakeEngine(zmq.Context.instance(), client, 0, pid=101))
    else:
        e0.status(how)
    _wait(lambda: client.engines[0].num_cached_blocks == 0, what="the index dropped")
    e0.events(stored=_hashes(PROMPT))  # late events of the old process change nothing
    e1.events(stored=[7])
    _wait(lambda: client.engines[1].num_cached_blocks == 1, what="engine 1's events")
    assert client.engines[0].num_cached_blocks == 0
    if how != "restart":
        # nothing goes to an engine after its death (or drain) was reported
        for i in range(3):
            assert _send(lt, client, request(f"after{i}", prompt=PROMPT + [i]), [e0, e1]) == 1
        assert client.engines[0].num_routed_while_down == 0


async def _call(fn, *args):
    return fn(*args)


# -- real engine processes -------------------------------------------------------------
@pytest.fixture(scope="module")
def real_pair(tiny_moe, tmp_path_factory):
    lt = LoopThread()
    tmp = tmp_path_factory.mktemp("kvreal")
    client = EngineClient(num_engines=2, runtime_dir=tmp)
    in_addr, _ = client.bind()
    procs = [spawn_engine(i, in_addr, tmp, engine_config(Path(tiny_moe))) for i in range(2)]
    try:
        lt.run(client.start(timeout_s=120), timeout_s=150)
        yield lt, client, procs
    finally:
        lt.run(client.close())
        for p in procs:
            stop_engine(p)
        lt.close()


async def _collect(client, req):
    return [o async for o in client.generate(req)]


def test_real_engines_follow_ups_hit_the_engine_that_holds_the_prefix(real_pair):
    lt, client, procs = real_pair
    first = request("conv-1", max_tokens=4, prompt=[20 + i % 50 for i in range(80)])
    lt.run(_collect(client, first))
    [holder] = [e for e in client.engines if e.num_routed == 1]
    other = next(e for e in client.engines if e is not holder)
    prompt_hashes = hash_request_blocks(first.prompt_token_ids, holder.block_size, [])
    assert holder.block_size == 16 and len(prompt_hashes) == 5
    _wait(lambda: all(h in holder.prefix for h in prompt_hashes), what="the engine's KV events")
    assert not any(h in other.prefix for h in prompt_hashes)
    for i in range(3):  # the conversation goes on: each turn extends the last
        follow = request(f"conv-{i + 2}", max_tokens=4, prompt=first.prompt_token_ids + [7] * (8 * (i + 1)))
        outs = lt.run(_collect(client, follow))
        assert outs[0].num_cached_tokens >= 80 - 80 % 16  # the engine's own cache hit
    assert holder.num_routed == 4 and client.router.decisions["prefix"] == 3
    assert holder.routed_hit_rate > 0.5
    outs = lt.run(_collect(client, salted(request("conv-salted", max_tokens=2,
                                                  prompt=first.prompt_token_ids + [7] * 8), "t2")))
    assert outs[0].num_cached_tokens == 0  # another salt: no hit in the engine
    assert client.router.decisions["no_prefix"] >= 2  # the first turn, and the salted one

    # the holder dies: its index goes with the death report, and nothing more is sent there
    victim = procs[holder.index]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(10)
    lt.run(_call(client.mark_engine_dead, holder.index, "killed by the test", victim.pid))
    assert holder.num_cached_blocks == 0
    again = request("conv-after", max_tokens=2, prompt=first.prompt_token_ids + [7] * 8)
    lt.run(_collect(client, again))
    assert other.num_routed >= 1 and holder.num_routed_while_down == 0
