"""engine/proc.py as a real process, driven by a hand-written frontend (RawFrontend)."""

import os
import random
import signal
import time
from pathlib import Path

import msgspec
import psutil
import pytest

from planaria.engine.messages import EngineCoreRequest
from planaria.engine.proc import EXIT_CONFIG_MISMATCH, EXIT_DEAD, EXIT_HANDSHAKE
from planaria.engine.wire import (PROTOCOL_VERSION, AbortRequests, MsgType, Shutdown, UtilityCall,
                         WireEncoder)
from tests.engine._engine_procs import (RawFrontend, engine_config, engine_log,
                                        request, spawn_engine, stop_engine)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="session")
def tiny_model(tiny_moe):  # tests/conftest.py builds it once per session
    return Path(tiny_moe)


@pytest.fixture
def short_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("p")  # ipc paths stay well under 100 bytes


@pytest.fixture
def started(tiny_model, short_tmp):
    """One engine (config delivered in the handshake) and its RawFrontend, READY done."""
    fe = RawFrontend(short_tmp)
    proc = spawn_engine(0, fe.input_addr, short_tmp, config=None, fault_injection=True)
    try:
        hello, ready = fe.handshake(0, settings={"engine_config": engine_config(tiny_model)})
        yield fe, proc, hello, ready
    finally:
        stop_engine(proc)
        fe.close()


def _utility(fe, method, args=None, call_id=1, index=0):
    fe.send(index, MsgType.UTILITY, UtilityCall(call_id=call_id, method=method, args=args or {}))
    while True:
        t, msg = fe.recv_pull()
        if t == MsgType.UTILITY_RESULT and msg.call_id == call_id:
            return msg


def test_handshake_and_generate_round_trip(started):
    fe, proc, hello, ready = started
    assert hello.pid == proc.pid and hello.protocol_version == PROTOCOL_VERSION
    assert ready.engine_index == 0 and ready.num_kv_blocks > 0 and ready.max_model_len == 256
    assert ready.kv_source == "given" and ready.config_hash and ready.pid == proc.pid
    fe.send(0, MsgType.ADD, request("a", max_tokens=6))
    outs = fe.collect({"a"})["a"]
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(tokens) == 6 and outs[-1].finish_reason == "length"
    assert all(0 <= t < ready.vocab_size for t in tokens)
    info = _utility(fe, "get_info")
    assert info.ok and info.result["state"] == "running" and info.result["step_counter"] >= 6
    assert not _utility(fe, "no_such_method", call_id=2).ok


def test_many_requests_and_abort(started):
    fe, proc, _, _ = started
    ids = {f"r{i}" for i in range(24)}
    for rid in sorted(ids):
        fe.send(0, MsgType.ADD, request(rid, max_tokens=5))
    fe.send(0, MsgType.ADD, request("long", max_tokens=200))
    fe.send(0, MsgType.ABORT, AbortRequests(request_ids=["long"]))
    got = fe.collect(ids | {"long"})
    assert all(len([t for o in got[r] for t in o.new_token_ids]) == 5 for r in ids)
    assert got["long"][-1].finish_reason == "abort"


def test_pinned_fault_fails_one_request_and_serving_goes_on(started):
    fe, proc, _, _ = started
    assert _utility(fe, "fault_inject", {"kind": "request"}).ok
    fe.send(0, MsgType.ADD, request("victim", max_tokens=4))
    assert fe.collect({"victim"})["victim"][-1].finish_reason == "error"
    fe.send(0, MsgType.ADD, request("after", max_tokens=4))
    assert fe.collect({"after"})["after"][-1].finish_reason == "length"
    assert proc.poll() is None


def test_malformed_frame_fuzz_engine_stays_up(started):
    fe, proc, _, _ = started
    rng = random.Random(1234)
    enc = WireEncoder(reuse_buffer=False, aux_min_items=8)
    valid = [enc.encode(MsgType.ADD, request("seed", prompt=list(range(20)))),
             enc.encode(MsgType.ABORT, AbortRequests(request_ids=["x"])),
             enc.encode(MsgType.UTILITY, UtilityCall(call_id=5, method="ping"))]
    valid = [[bytes(f) for f in frames] for frames in valid]
    t0 = time.monotonic()
    num_sent = 0
    for i in range(3000):
        r = rng.random()
        if r < 0.25:  # pure noise: random frame count, random bytes
            frames = [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(0, 5))]
        elif r < 0.35:  # a known type byte (never SHUTDOWN) with a random payload
            t = rng.choice([MsgType.ADD, MsgType.ABORT, MsgType.UTILITY, MsgType.WAKEUP,
                            MsgType.HELLO, MsgType.OUTPUTS, b"\x00", b"\xff"])
            frames = [t, rng.randbytes(rng.randrange(0, 200))]
        elif r < 0.45:  # deep nesting (msgspec raises RecursionError), bare or inside a field
            t = rng.choice([MsgType.ADD, MsgType.ABORT, MsgType.UTILITY, MsgType.HANDSHAKE_INIT,
                            MsgType.HANDSHAKE_REJECT])
            frames = [t, _deep_payload(rng)]
        else:  # a valid message, mutated
            frames = [bytearray(f) for f in rng.choice(valid)]
            k = rng.randrange(len(frames))
            for _ in range(rng.randint(1, 6)):
                if frames[k]:
                    frames[k][rng.randrange(len(frames[k]))] = rng.randrange(256)
            if rng.random() < 0.2:
                frames[k] = frames[k][:rng.randrange(len(frames[k]) + 1)]
            if rng.random() < 0.1:
                frames.append(rng.randbytes(7))
            frames = [bytes(f) for f in frames]
            if frames and frames[0] == MsgType.SHUTDOWN:
                continue
        if not frames:
            frames = [b""]
        fe.send_raw(0, frames)
        num_sent += 1
    _caught_up(fe)  # (the ROUTER drops what does not fit the engine's queue: no drops below)
    # schema-valid msgpack with a recoverable request id gets an error output for that id
    fe.send_raw(0, [MsgType.ADD, msgspec.msgpack.encode({"request_id": "bad-schema", "prompt_token_ids": 7})])
    # ... and so does one nested too deeply for msgspec in a field the schema leaves open
    fe.send_raw(0, [MsgType.ADD, _deep_add("deep-field")])
    fe.send(0, MsgType.ADD, request("normal", max_tokens=4))
    got = fe.collect({"bad-schema", "deep-field", "normal"}, timeout_s=60)
    print(f"fuzz: {num_sent} frames in {time.monotonic() - t0:.2f} s")
    assert got["bad-schema"][-1].finish_reason == "error" and "malformed" in got["bad-schema"][-1].error
    assert got["bad-schema"][-1].error_code == "invalid_request"
    assert got["deep-field"][-1].finish_reason == "error" and "nested too deeply" in got["deep-field"][-1].error
    assert got["normal"][-1].finish_reason == "length"
    assert proc.poll() is None, engine_log(proc)
    assert _utility(fe, "ping", call_id=99).ok


def _caught_up(fe, timeout_s: float = 120.0) -> None:
    """Until the engine answers a ping sent now, i.e. it has read everything sent before."""
    deadline = time.monotonic() + timeout_s
    call_ids = set()
    while time.monotonic() < deadline:
        call_ids.add(10_000 + len(call_ids))
        fe.send(0, MsgType.UTILITY, UtilityCall(call_id=max(call_ids), method="ping"))
        until = time.monotonic() + 2.0
        while time.monotonic() < until:
            try:
                t, msg = fe.recv_pull(0.5)
            except TimeoutError:
                continue
            if t == MsgType.UTILITY_RESULT and msg.call_id in call_ids:
                return
    raise TimeoutError("the engine never answered a ping")


def _deep_payload(rng) -> bytes:
    """msgpack nested deeper than msgspec's recursion limit: arrays, maps, or a valid ADD
    whose open-typed field holds the nesting."""
    depth = rng.choice([1100, 5000, 100_000])
    kind = rng.randrange(3)
    if kind == 0:
        return b"\x91" * depth + b"\xc0"
    if kind == 1:
        return b"\x81\xa1k" * depth + b"\xc0"
    return _deep_add(f"deep{rng.randrange(10**6)}", depth)


def _deep_add(rid: str, depth: int = 100_000) -> bytes:
    """An ADD with a good request id whose structured_output (a dict of anything) is nested
    ``depth`` lists deep."""
    head = msgspec.msgpack.encode(request(rid))
    assert head[0] & 0xF0 == 0x80 and head[0] & 0x0F < 15  # a fixmap: one more key fits
    return bytes([head[0] + 1]) + head[1:] + msgspec.msgpack.encode("structured_output") \
        + b"\x81\xa1v" + b"\x91" * depth + b"\xc0"


def test_oversize_message_is_refused(started):
    fe, proc, _, _ = started
    big = EngineCoreRequest(request_id="huge", prompt_token_ids=[1] * 100,
                            sampling_params=request("x").sampling_params)
    payload = msgspec.msgpack.encode(big)
    fe.send_raw(0, [MsgType.ADD, payload, b"\x00" * (300 * 2**20)])
    got = fe.collect({"huge"})
    assert got["huge"][-1].finish_reason == "error" and "exceeds" in got["huge"][-1].error
    assert proc.poll() is None


def test_sigterm_drains_then_exits_zero(started):
    fe, proc, _, _ = started
    ids = {"d1", "d2", "d3"}
    for rid in sorted(ids):
        fe.send(0, MsgType.ADD, request(rid, max_tokens=40))
    # wait until they run, then ask for a drain
    while True:
        t, msg = fe.recv_pull()
        if t == MsgType.OUTPUTS and any(o.new_token_ids for o in msg.outputs):
            break
    proc.send_signal(signal.SIGTERM)
    statuses = []
    while "draining" not in statuses:
        t, msg = fe.recv_pull()
        if t == MsgType.STATUS:
            statuses.append(msg.state)
    fe.send(0, MsgType.ADD, request("late", max_tokens=4))
    got = fe.collect(ids | {"late"})
    assert got["late"][-1].finish_reason == "error" and "draining" in got["late"][-1].error
    for rid in ids:
        assert got[rid][-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in got[rid]) == 40
    assert proc.wait(30) == 0, engine_log(proc)
    while True:  # the last word is STOPPED, with nothing dropped
        t, msg = fe.recv_pull(5)
        if t == MsgType.STATUS and msg.state == "stopped":
            assert not msg.requests_dropped
            break


def test_shutdown_zero_aborts_and_reports_dropped_work(started):
    fe, proc, _, _ = started
    fe.send(0, MsgType.ADD, request("busy", max_tokens=200))
    fe.send(0, MsgType.SHUTDOWN, Shutdown(drain_timeout_s=0.0))
    while True:
        t, msg = fe.recv_pull()
        if t == MsgType.STATUS and msg.state == "stopped":
            assert msg.requests_dropped
            break
    assert proc.wait(30) == 0


def test_fatal_fault_sends_engine_core_dead_and_exits_nonzero(started):
    fe, proc, _, _ = started
    fe.send(0, MsgType.ADD, request("doomed", max_tokens=200))
    assert _utility(fe, "fault_inject", {"kind": "fatal"}).ok
    while True:
        t, msg = fe.recv_pull()
        if t == MsgType.ENGINE_CORE_DEAD:
            assert msg.engine_index == 0 and "injected" in msg.reason and msg.pid == proc.pid
            break
    assert proc.wait(30) == EXIT_DEAD


def _unhealthy_engine(tiny_model, short_tmp):
    """An engine that keeps its requests across a fault, made UNHEALTHY with one request in."""
    fe = RawFrontend(short_tmp)
    proc = spawn_engine(0, fe.input_addr, short_tmp, engine_config(tiny_model), fault_injection=True,
                        settings={"recovery_timeout_s": 30.0, "keep_requests_on_fault": True})
    fe.handshake(0)
    assert _utility(fe, "fault_inject", {"kind": "fatal"}).ok
    fe.send(0, MsgType.ADD, request("kept", max_tokens=8))
    while True:
        t, msg = fe.recv_pull()
        if t == MsgType.STATUS and msg.state == "unhealthy":
            assert not msg.requests_dropped and "injected" in msg.reason
            break
    fe.send(0, MsgType.ADD, request("refused", max_tokens=8))
    assert fe.collect({"refused"})["refused"][-1].error.startswith("engine is unhealthy")
    assert proc.poll() is None
    return fe, proc


def test_unhealthy_then_reset_drops_work_and_serves_again(tiny_model, short_tmp):
    fe, proc = _unhealthy_engine(tiny_model, short_tmp)
    try:
        assert _utility(fe, "reset", call_id=2).ok
        last = fe.statuses[-1]
        assert last.state == "running" and last.requests_dropped  # "kept" is gone: replay it
        fe.send(0, MsgType.ADD, request("fresh", max_tokens=5))
        assert fe.collect({"fresh"})["fresh"][-1].finish_reason == "length"
    finally:
        stop_engine(proc)
        fe.close()


def test_unhealthy_then_resume_keeps_requests(tiny_model, short_tmp):
    from planaria.engine.core import EngineCore

    if not hasattr(EngineCore, "recover_after_fault"):
        pytest.skip("EngineCore has no recover_after_fault(): a failed step's batch stays in flight")
    fe, proc = _unhealthy_engine(tiny_model, short_tmp)
    try:
        assert _utility(fe, "resume", call_id=2).ok
        got = fe.collect({"kept"})
        assert got["kept"][-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in got["kept"]) == 8
    finally:
        stop_engine(proc)
        fe.close()


def test_unhealthy_without_recovery_dies_after_the_window(tiny_model, short_tmp):
    fe = RawFrontend(short_tmp)
    proc = spawn_engine(0, fe.input_addr, short_tmp, engine_config(tiny_model), fault_injection=True,
                        settings={"recovery_timeout_s": 0.5})
    try:
        fe.handshake(0)
        assert _utility(fe, "fault_inject", {"kind": "fatal"}).ok
        fe.send(0, MsgType.ADD, request("lost", max_tokens=8))
        states = []
        while True:
            t, msg = fe.recv_pull()
            if t == MsgType.STATUS:
                states.append((msg.state, msg.requests_dropped))
            if t == MsgType.ENGINE_CORE_DEAD:
                assert "no recovery" in msg.reason
                break
        assert states == [("unhealthy", True)]
        assert proc.wait(30) == EXIT_DEAD
    finally:
        stop_engine(proc)
        fe.close()


def test_protocol_mismatch_engine_refuses_and_exits(tiny_model, short_tmp):
    fe = RawFrontend(short_tmp)
    proc = spawn_engine(0, fe.input_addr, short_tmp, engine_config(tiny_model))
    try:
        fe.handshake(0, protocol_version=PROTOCOL_VERSION + 98)
        assert proc.wait(30) == EXIT_CONFIG_MISMATCH
        assert "speaks protocol" in engine_log(proc)
    finally:
        stop_engine(proc)
        fe.close()


def test_handshake_timeout_exits_with_its_own_code(short_tmp, tiny_model):
    proc = spawn_engine(2, f"ipc://{short_tmp / 'nobody'}", short_tmp, engine_config(tiny_model),
                        settings={"handshake_timeout_s": 1.0})
    try:
        assert proc.wait(60) == EXIT_HANDSHAKE
        assert "no HANDSHAKE_INIT within" in engine_log(proc)
    finally:
        stop_engine(proc)


def test_sigterm_while_waiting_for_handshake_exits_zero(short_tmp, tiny_model):
    fe = RawFrontend(short_tmp, name="mute")  # takes the HELLO and never answers it
    proc = spawn_engine(3, fe.input_addr, short_tmp, engine_config(tiny_model))
    try:
        _identity, msg_type, _hello = fe.recv_router(60)  # handlers installed, handshake begun
        assert msg_type == MsgType.HELLO
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0, engine_log(proc)
    finally:
        stop_engine(proc)
        fe.close()


def _main_thread(pid: int) -> tuple[str, int]:
    """The process's main thread (Linux: the task whose id is the pid): its scheduler state
    ('S': asleep) and how often it has gone to sleep (voluntary context switches)."""
    task = Path(f"/proc/{pid}/task/{pid}")
    state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    switches = next(int(line.split()[1]) for line in (task / "status").read_text().splitlines()
                    if line.startswith("voluntary_ctxt_switches:"))
    return state, switches


IDLE_WINDOW_S = 3.0


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_sigterm_wakes_an_idle_loop(started):
    """An idle loop blocks on its input queue with no timeout, and SIGTERM's handler puts a
    WAKEUP on that queue: the loop sleeps through an idle stretch without waking, yet
    answers the signal at once. A loop that polled (a sleep, a get with a timeout) every
    1.5 s or less would wake at least twice in the window (a longer period would likely
    miss the 1 s bound on the answer); one that spun would burn CPU; one blocked with no
    wake-up would never drain."""
    fe, proc, _, _ = started
    assert _utility(fe, "ping", call_id=7).ok  # the loop has read its input: idle from here
    deadline = time.monotonic() + 10
    while _main_thread(proc.pid)[0] != "S":  # until it is asleep on the empty queue
        assert time.monotonic() < deadline, "the idle loop never went to sleep"
        time.sleep(0.01)
    engine = psutil.Process(proc.pid)
    wakeups0, cpu0, t0 = _main_thread(proc.pid)[1], engine.cpu_times(), time.monotonic()
    time.sleep(IDLE_WINDOW_S)
    wakeups = _main_thread(proc.pid)[1] - wakeups0
    cpu1, idle_s = engine.cpu_times(), time.monotonic() - t0
    cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    t_signal = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    while not any(s.state == "draining" for s in fe.statuses):
        fe.recv_pull(10.0)
    draining_after_s = time.monotonic() - t_signal
    assert proc.wait(10) == 0
    exited_after_s = time.monotonic() - t_signal
    print(f"idle {idle_s:.2f} s: main thread woke {wakeups} times, {cpu_s * 1e3:.0f} ms CPU (all threads); "
          f"SIGTERM -> DRAINING {draining_after_s * 1e3:.0f} ms, -> exit {exited_after_s:.2f} s")
    assert wakeups <= 1, f"the idle loop woke {wakeups} times in {idle_s:.2f} s: it polls"
    assert cpu_s < 0.1 * idle_s, f"{cpu_s:.2f} s of CPU in {idle_s:.2f} s idle: it spins"
    # generous for a loaded 2-core machine (measured: a few ms)
    assert draining_after_s < 1.0, f"SIGTERM answered {draining_after_s:.2f} s late"


def test_abort_during_a_forward_gets_no_token_and_frees_blocks(tiny_model, short_tmp):
    """Two 2000-token prefills make one long forward (~0.2 s); an ABORT sent 40 ms into it
    reaches the core through the input thread's eager path and is applied before that
    step's outputs, so the requests finish "abort" with no token although the step that
    would have sampled their first token ran (its iteration record says so)."""
    fe = RawFrontend(short_tmp)
    cfg = engine_config(tiny_model, max_model_len=2048, max_num_batched_tokens=4096,
                        kv_cache_bytes=64 * 2**20, iteration_details=True)
    proc = spawn_engine(0, fe.input_addr, short_tmp, cfg)
    try:
        fe.handshake(0)
        hits = []
        for attempt in range(5):
            ids = [f"big{attempt}-{j}" for j in range(2)]
            for j, rid in enumerate(ids):
                fe.send(0, MsgType.ADD, request(rid, max_tokens=50,
                                                prompt=[3 + (7 * i + 11 * j + attempt) % 4000 for i in range(2000)]))
            time.sleep(0.04)
            t_abort = time.time()
            fe.send(0, MsgType.ABORT, AbortRequests(request_ids=ids))
            got = fe.collect(set(ids))
            # Valid attempts: a step that computed a whole prompt (so it samples) and whose
            # outputs were published after the ABORT was sent.
            in_forward = {rid for ts, d in fe.iterations if ts > t_abort
                          for rid, n in zip(d.request_ids, d.num_scheduled_tokens) if rid in ids and n == 2000}
            for rid in ids:
                assert got[rid][-1].finish_reason == "abort", got[rid]
                if rid in in_forward:
                    assert [t for o in got[rid] for t in o.new_token_ids] == [], engine_log(proc)
            hits += in_forward
            if len(hits) >= 2:
                break
        assert hits, f"no ABORT landed inside a forward in 5 tries: {fe.iterations}"
        stats = _utility(fe, "get_stats", call_id=7)
        assert stats.ok and stats.result["kv_usage"] == 0.0 and stats.result["num_running"] == 0
        fe.send(0, MsgType.ADD, request("after", max_tokens=3))
        assert fe.collect({"after"})["after"][-1].finish_reason == "length"
    finally:
        stop_engine(proc)
        fe.close()
