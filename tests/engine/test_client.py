"""engine/client.py against real engine processes on the tiny-moe demo model."""

import asyncio
import os
import signal
import statistics
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from planaria.engine.client import EngineClient
from planaria.engine.errors import EngineDeadError, EngineHandshakeError, NoEngineAvailableError
from planaria.engine.wire import (PROTOCOL_VERSION, EngineDead, Hello, MsgType, Ready, WireDecoder,
                         WireEncoder, ENGINE_INPUT_TYPES, engine_identity)
from tests.engine._engine_procs import (LoopThread, engine_config, engine_log,
                                        request, spawn_engine, stop_engine)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="session")
def tiny_model(tiny_moe):  # tests/conftest.py builds it once per session
    return Path(tiny_moe)


def _start_cluster(lt, tmp, model, n, **client_kw):
    client = EngineClient(num_engines=n, runtime_dir=tmp, **client_kw)
    in_addr, _ = client.bind()
    procs = [spawn_engine(i, in_addr, tmp, engine_config(model), fault_injection=True) for i in range(n)]
    try:
        lt.run(client.start(timeout_s=120), timeout_s=150)
    except Exception:
        for p in procs:
            stop_engine(p)
        raise
    return client, procs


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    lt = LoopThread()
    tmp = tmp_path_factory.mktemp("c")
    client, procs = _start_cluster(lt, tmp, tiny_model, 2)
    try:
        yield lt, client, procs
    finally:
        lt.run(client.close())
        for p in procs:
            stop_engine(p)
        lt.close()


async def _collect(client, req):
    return [out async for out in client.generate(req)]


def _tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def test_generate_round_trip(cluster):
    lt, client, procs = cluster
    outs = lt.run(_collect(client, request("one", max_tokens=7)))
    assert len(_tokens(outs)) == 7 and outs[-1].finish_reason == "length"
    assert [e.pid for e in client.engines] == [p.pid for p in procs]
    assert all(e.healthy and e.num_kv_blocks > 0 and e.kv_source == "given" for e in client.engines)
    # greedy decoding is deterministic, whichever engine serves it
    again = lt.run(_collect(client, request("one-again", max_tokens=7)))
    assert _tokens(again) == _tokens(outs)


def test_many_concurrent_streams_spread_over_engines(cluster):
    lt, client, _ = cluster
    seen_in_flight = {0: 0, 1: 0}

    async def one(i):
        n = 0
        async for out in client.generate(request(f"c{i}", max_tokens=6, prompt=[20 + i, 21, 22])):
            n += len(out.new_token_ids)
            for e in client.engines:
                seen_in_flight[e.index] = max(seen_in_flight[e.index], e.num_in_flight)
        return n

    async def all_of_them():
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(40)))
        return counts, time.perf_counter() - t0

    counts, elapsed = lt.run(all_of_them())
    print(f"40 concurrent streams x 6 tokens over 2 engines: {elapsed:.2f} s")
    assert counts == [6] * 40
    assert seen_in_flight[0] > 0 and seen_in_flight[1] > 0
    assert all(e.num_in_flight == 0 for e in client.engines)


def test_abort_mid_stream(cluster):
    lt, client, _ = cluster

    async def leave_early():
        got = 0
        async for out in client.generate(request("leaver", max_tokens=200)):
            got += len(out.new_token_ids)
            if got >= 3:
                break  # the client went away: the generator's cleanup aborts on the engine
        await asyncio.sleep(0)

    async def explicit_abort():
        outs = []
        async for out in client.generate(request("aborted", max_tokens=200)):
            outs.append(out)
            if len(outs) == 2:
                await client.abort("aborted")
        return outs

    async def engines_idle():
        for _ in range(100):
            stats = [await client.call_utility(e.index, "get_stats") for e in client.engines]
            if all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats):
                return True
            await asyncio.sleep(0.05)
        return False

    lt.run(leave_early())
    outs = lt.run(explicit_abort())
    assert outs[-1].finish_reason == "abort" and len(_tokens(outs)) < 200
    assert lt.run(engines_idle())
    assert not client._streams


def test_utility_round_trip_overhead(cluster):
    lt, client, _ = cluster

    async def pings(n):
        rtts = []
        for _ in range(n):
            t0 = time.perf_counter()
            await client.call_utility(0, "ping")
            rtts.append(time.perf_counter() - t0)
        return rtts

    async def one_token(n):
        lat = []
        for i in range(n):
            t0 = time.perf_counter()
            await _collect(client, request(f"lat{i}", max_tokens=1))
            lat.append(time.perf_counter() - t0)
        return lat

    rtts = lt.run(pings(300))
    lat = lt.run(one_token(30))
    med = statistics.median(rtts)
    print(f"utility ping RTT: median {med * 1e6:.0f} us, p99 {sorted(rtts)[296] * 1e6:.0f} us; "
          f"1-token generate: median {statistics.median(lat) * 1e3:.2f} ms")
    assert med < 0.02


def test_protocol_and_config_mismatch_refused(tmp_path_factory):
    lt = LoopThread()
    tmp = tmp_path_factory.mktemp("m")
    client = EngineClient(num_engines=1, runtime_dir=tmp, expected_config_hash="abc")
    in_addr, _ = client.bind()
    ctx = zmq.Context()
    enc, dec = WireEncoder(reuse_buffer=False), WireDecoder(ENGINE_INPUT_TYPES)
    socks = []
    try:
        lt.run(client.start(wait_ready=False))

        def fake_engine(index):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, engine_identity(index))
            s.setsockopt(zmq.LINGER, 0)
            s.connect(in_addr)
            socks.append(s)
            return s

        old = fake_engine(5)
        old.send_multipart(enc.encode(MsgType.HELLO, Hello(engine_index=5, pid=1, protocol_version=PROTOCOL_VERSION + 1)))
        assert old.poll(5000)
        t, msg = dec.decode(old.recv_multipart())
        assert t == MsgType.HANDSHAKE_REJECT and "protocol" in msg.reason
        with pytest.raises(EngineHandshakeError, match="speaks protocol"):
            lt.run(client.wait_for_engines(1, 5.0))
        assert client.engines[0].state == "refused"

        other = fake_engine(6)
        other.send_multipart(enc.encode(MsgType.HELLO, Hello(engine_index=6, pid=2, protocol_version=PROTOCOL_VERSION)))
        assert other.poll(5000)
        t, init = dec.decode(other.recv_multipart())
        assert t == MsgType.HANDSHAKE_INIT and init.addresses["output"] == client.output_address
        other.send_multipart(enc.encode(MsgType.READY, Ready(
            engine_index=6, num_kv_blocks=1, max_model_len=8, protocol_version=PROTOCOL_VERSION,
            config_hash="not-abc", kv_cache_bytes=1, kv_source="given", pid=2)))
        assert other.poll(5000)
        t, msg = dec.decode(other.recv_multipart())
        assert t == MsgType.HANDSHAKE_REJECT  # refused, and told why
        assert "config hash not-abc" in msg.reason and "abc" in msg.reason
        assert {e.index: e.state for e in client.engines} == {5: "refused", 6: "refused"}
        with pytest.raises(NoEngineAvailableError):
            lt.run(_collect(client, request("nowhere")))
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        lt.run(client.close())
        lt.close()


def test_engine_death_failover_and_restart(tiny_model, tmp_path_factory):
    lt = LoopThread()
    tmp = tmp_path_factory.mktemp("d")
    client, procs = _start_cluster(lt, tmp, tiny_model, 2)
    ctx = zmq.Context()
    try:
        # 1. a fatal fault in engine 0's loop: its streams raise EngineDeadError promptly
        async def stream_until_error(rid):
            n = 0
            try:
                async for out in client.generate(request(rid, max_tokens=200, prompt=[30, 31, 32])):
                    n += len(out.new_token_ids)
                return ("finished", n, time.perf_counter())
            except EngineDeadError as exc:
                return ("dead", exc.engine_index, time.perf_counter())

        async def fault_engine0():
            tasks = [asyncio.create_task(stream_until_error(f"v{i}")) for i in range(4)]
            while not all(e.num_in_flight >= 2 for e in client.engines):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            # an upper bound: from sending the fault (it fires on the next step) to the error
            t0 = time.perf_counter()
            await client.call_utility(0, "fault_inject", {"kind": "fatal"})
            return t0, await asyncio.gather(*tasks)

        t0, results = lt.run(fault_engine0())
        dead = [r for r in results if r[0] == "dead"]
        assert len(dead) == 2 and all(r[1] == 0 for r in dead), results
        latency_s = max(r[2] for r in dead) - t0
        print(f"fault injected -> EngineDeadError in every stream: {latency_s * 1e3:.1f} ms (upper bound)")
        assert latency_s < 0.5
        assert [r[1] for r in results if r[0] == "finished"] == [200, 200]
        assert procs[0].wait(30) == 1, engine_log(procs[0])
        assert client.engines[0].state == "dead" and not client.engines[0].healthy
        outs = lt.run(_collect(client, request("after-death", max_tokens=3)))
        assert len(_tokens(outs)) == 3  # served by engine 1

        # 2. the supervisor restarts engine 0: a new HELLO makes it healthy again
        procs[0] = spawn_engine(0, client.input_address, tmp, engine_config(tiny_model), fault_injection=True)
        lt.run(client.wait_for_engines(2, 120.0), timeout_s=150)
        assert client.engines[0].pid == procs[0].pid and client.engines[0].num_handshakes == 2

        # 3. SIGKILL one engine (it can say nothing); the supervisor reports it on the PULL socket
        async def wait_until(cond, timeout_s=30.0):
            deadline = time.monotonic() + timeout_s
            while not cond():
                assert time.monotonic() < deadline, "condition not reached"
                await asyncio.sleep(0.01)

        async def kill_one_with_work():
            hog = asyncio.create_task(stream_until_error("hog"))  # loads one engine...
            await wait_until(lambda: sum(e.num_in_flight for e in client.engines) == 1)
            busy = next(e.index for e in client.engines if e.num_in_flight == 1)
            victim_index = 1 - busy
            task = asyncio.create_task(stream_until_error("k1"))  # ...so this goes to the other
            await wait_until(lambda: client.engines[victim_index].num_in_flight == 1)
            victim = procs[victim_index]
            os.kill(victim.pid, signal.SIGKILL)
            # the victim is gone (its sockets closed), and the client has read a reply the
            # survivor sent after that: it had its chance to guess, and did not
            await asyncio.get_running_loop().run_in_executor(None, victim.wait, 10)
            await client.call_utility(busy, "ping")
            assert not task.done()  # nothing said yet: the stream waits
            sup = ctx.socket(zmq.PUSH)
            sup.setsockopt(zmq.LINGER, 1000)
            sup.connect(client.output_address)
            sup.send_multipart(WireEncoder().encode(MsgType.ENGINE_CORE_DEAD, EngineDead(
                engine_index=victim_index, reason="killed by signal 9", pid=victim.pid)))
            sup.close()
            return victim_index, await asyncio.wait_for(task, 5.0), await asyncio.wait_for(hog, 60.0)

        victim_index, result, hog = lt.run(kill_one_with_work())
        assert result[0] == "dead" and result[1] == victim_index
        assert hog[0] == "finished"
        assert procs[victim_index].wait(10) == -signal.SIGKILL
        assert client.engines[victim_index].state == "dead"
        assert len(_tokens(lt.run(_collect(client, request("on-survivor", max_tokens=3))))) == 3
    finally:
        ctx.destroy(0)
        lt.run(client.close())
        for p in procs:
            stop_engine(p)
        lt.close()


def test_config_hash_mismatch_stops_a_real_engine_with_a_distinct_code(tiny_model, tmp_path_factory):
    """READY's config hash differs from the one the client expects: the client answers
    HANDSHAKE_REJECT with the reason; the engine logs it and exits EXIT_CONFIG_MISMATCH."""
    from planaria.engine.proc import EXIT_CONFIG_MISMATCH

    lt = LoopThread()
    tmp = tmp_path_factory.mktemp("h")
    client = EngineClient(num_engines=1, runtime_dir=tmp, expected_config_hash="0123456789abcdef")
    in_addr, _ = client.bind()
    proc = spawn_engine(0, in_addr, tmp, engine_config(tiny_model))
    try:
        with pytest.raises(EngineHandshakeError, match="config hash"):
            lt.run(client.start(timeout_s=120), timeout_s=150)
        assert client.engines[0].state == "refused"
        assert proc.wait(30) == EXIT_CONFIG_MISMATCH, engine_log(proc)
        log_text = engine_log(proc)
        assert "refused this engine" in log_text and "0123456789abcdef" in log_text
    finally:
        stop_engine(proc)
        lt.run(client.close())
        lt.close()


def test_engine_core_dead_reaches_the_client_within_100ms(tiny_model, tmp_path_factory):
    """A fatal fault in the engine's busy loop: every in-flight stream raises EngineDeadError
    within 100 ms of the fault, timed from the engine's own clock reading at the fault
    (ENGINE_CORE_DEAD carries it; CLOCK_MONOTONIC is one clock for every process here)."""
    from planaria.engine.proc import EXIT_DEAD

    lt = LoopThread()
    tmp = tmp_path_factory.mktemp("f")
    client, procs = _start_cluster(lt, tmp, tiny_model, 1)
    try:
        async def stream(rid, started):
            try:
                async for out in client.generate(request(rid, max_tokens=200, prompt=[50, 51, 52])):
                    if out.new_token_ids:
                        started.add(rid)
                return None
            except EngineDeadError:
                return time.monotonic()

        async def fault_with_streams():
            started = set()
            tasks = [asyncio.create_task(stream(f"f{i}", started)) for i in range(4)]
            while len(started) < 4:  # every stream is getting tokens
                await asyncio.sleep(0.005)
            t_inject = time.monotonic()
            await client.call_utility(0, "fault_inject", {"kind": "fatal"})  # the next step raises
            return t_inject, await asyncio.gather(*tasks)

        t_inject, raised_at = lt.run(fault_with_streams())
        fault_s = client.engines[0].fault_monotonic_s
        assert None not in raised_at, raised_at
        assert t_inject < fault_s < min(raised_at)
        latency_ms = [(t - fault_s) * 1e3 for t in raised_at]
        print(f"fault -> EngineDeadError in each of 4 streams: {', '.join(f'{x:.1f}' for x in latency_ms)} ms")
        assert max(latency_ms) < 100.0
        assert procs[0].wait(30) == EXIT_DEAD, engine_log(procs[0])
        assert client.engines[0].state == "dead"
    finally:
        lt.run(client.close())
        for p in procs:
            stop_engine(p)
        lt.close()


def test_second_sigterm_during_a_drain_aborts_at_once(tiny_model, tmp_path_factory):
    """SIGTERM starts a drain (30 s allowed); a second SIGTERM while 12 long requests are
    still running aborts them: every stream raises EngineDeadError saying why, and the
    process exits 0 at once instead of finishing the drain."""
    lt = LoopThread()
    tmp = tmp_path_factory.mktemp("s")
    client, procs = _start_cluster(lt, tmp, tiny_model, 1)
    proc = procs[0]
    try:
        async def stream(rid, counts):
            try:
                async for out in client.generate(request(rid, max_tokens=240, prompt=[60, 61, 62])):
                    counts[rid] = counts.get(rid, 0) + len(out.new_token_ids)
                return "finished", None
            except EngineDeadError as exc:
                return "aborted", exc

        async def drain_then_abort():
            counts: dict[str, int] = {}
            tasks = [asyncio.create_task(stream(f"d{i}", counts)) for i in range(12)]
            while len(counts) < 12:
                await asyncio.sleep(0.005)
            proc.send_signal(signal.SIGTERM)
            while client.engines[0].state != "draining":
                await asyncio.sleep(0.002)
            t_second = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            return t_second, time.monotonic() - t_second, results, counts

        t_second, errors_s, results, counts = lt.run(drain_then_abort())
        exit_code = proc.wait(10)
        exit_s = time.monotonic() - t_second
        print(f"second SIGTERM -> every stream failed in {errors_s * 1e3:.0f} ms, exit after {exit_s:.2f} s")
        assert exit_code == 0, engine_log(proc)
        assert [r[0] for r in results] == ["aborted"] * 12, results
        assert all(counts[f"d{i}"] < 240 for i in range(12))  # cut short, not drained
        for _, exc in results:
            assert exc.engine_index == 0 and "signal #2" in exc.reason and "in-flight work aborted" in exc.reason
        assert errors_s < 0.5 and exit_s < 1.5
        assert client.engines[0].state == "stopped"
    finally:
        lt.run(client.close())
        for p in procs:
            stop_engine(p)
        lt.close()


def test_engine_info_state_takes_every_lifecycle_state_and_prints_as_before():
    """EngineInfo.state is an enum now; status text and JSON still read "running"."""
    import json

    from planaria.engine.client import EngineInfoState
    from planaria.engine.lifecycle import EngineState

    assert all(EngineInfoState(s.value) == s.value for s in EngineState)
    state = EngineInfoState.RUNNING
    assert (str(state), f"{state}", "%s" % state, json.dumps(state)) == ("running", "running", "running", '"running"')
    assert msgspec.json.encode({"state": state}) == b'{"state":"running"}' and state == "running"


DEEP = b"\x91" * 100_000 + b"\xc0"  # msgpack: a list in a list ... 100,000 deep: RecursionError in msgspec


def test_readers_survive_deeply_nested_frames_and_deliver_the_next_good_one(tmp_path_factory):
    """A fake engine on real ZMQ sockets: after deeply nested (and otherwise bad) frames on
    both the ROUTER and the PULL socket, the handshake, an output and a utility result
    still get through: neither reader task ended."""
    from planaria.engine.messages import EngineCoreOutput, EngineCoreOutputs
    from planaria.engine.wire import UtilityResult

    lt = LoopThread()
    tmp = tmp_path_factory.mktemp("deep")
    client = EngineClient(num_engines=1, runtime_dir=tmp)
    in_addr, out_addr = client.bind()
    ctx = zmq.Context()
    enc, dec = WireEncoder(reuse_buffer=False), WireDecoder(ENGINE_INPUT_TYPES)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, engine_identity(0))
    dealer.setsockopt(zmq.LINGER, 0)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        lt.run(client.start(wait_ready=False))
        dealer.connect(in_addr)
        for frames in ([MsgType.HELLO, DEEP], [MsgType.READY, DEEP], [MsgType.HELLO, b"\xc1"], [b"\x99"]):
            dealer.send_multipart(frames)
        dealer.send_multipart(enc.encode(MsgType.HELLO, Hello(engine_index=0, pid=4242,
                                                             protocol_version=PROTOCOL_VERSION)))
        assert dealer.poll(10_000), "the ROUTER reader stopped after the nested frames"
        t, init = dec.decode(dealer.recv_multipart())
        assert t == MsgType.HANDSHAKE_INIT
        push.connect(init.addresses["output"])
        dealer.send_multipart(enc.encode(MsgType.READY, Ready(
            engine_index=0, num_kv_blocks=8, max_model_len=64, protocol_version=PROTOCOL_VERSION,
            config_hash="h", kv_cache_bytes=1, kv_source="given", pid=4242)))
        lt.run(client.wait_for_engines(1, 10.0))

        async def generate_one():
            return await asyncio.wait_for(_collect(client, request("good", max_tokens=1)), 20)

        fut = asyncio.run_coroutine_threadsafe(generate_one(), lt.loop)
        assert dealer.poll(10_000)
        t, add = dec.decode(dealer.recv_multipart())
        assert t == MsgType.ADD and add.request_id == "good"
        for frames in ([MsgType.OUTPUTS, DEEP], [MsgType.UTILITY_RESULT, DEEP], [MsgType.STATUS, DEEP],
                       [MsgType.OUTPUTS, b"\x91" * 2000 + b"\xc0", b"x", b"y", b"z"], [MsgType.OUTPUTS]):
            push.send_multipart(frames)
        push.send_multipart(enc.encode(MsgType.OUTPUTS, EngineCoreOutputs(engine_index=0, outputs=[
            EngineCoreOutput(request_id="good", new_token_ids=[7], finish_reason="length")])))
        outs = fut.result(30)
        assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([7], "length")]
        assert client.num_bad_messages >= 8

        async def call():
            return await client.call_utility(0, "ping", timeout_s=20)

        fut = asyncio.run_coroutine_threadsafe(call(), lt.loop)
        assert dealer.poll(10_000)
        t, utility = dec.decode(dealer.recv_multipart())
        assert t == MsgType.UTILITY
        push.send_multipart([MsgType.UTILITY_RESULT, DEEP])
        push.send_multipart(enc.encode(MsgType.UTILITY_RESULT, UtilityResult(
            call_id=utility.call_id, ok=True, result={"pong": 1})))
        assert fut.result(30) == {"pong": 1}
        assert client.engines[0].state == "running"
    finally:
        dealer.close(0)
        push.close(0)
        ctx.term()
        lt.run(client.close())
        lt.close()
