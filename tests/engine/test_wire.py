"""engine/wire.py: frames round-trip, aux arrays, and every malformed input is a WireFormatError."""

import random

import msgspec
import pytest

from planaria.engine.errors import WireFormatError
from planaria.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, Logprobs, SchedulerStats
from planaria.engine.sampling_params import SamplingParams
from planaria.engine.wire import (ENGINE_INPUT_TYPES, FRONTEND_INPUT_TYPES, AbortRequests, EngineDead, Hello,
                         MsgType, UtilityCall, UtilityErrorCode, UtilityResult, WireDecoder, WireEncoder,
                         engine_identity, engine_index_of, recover_call_id)


def _req(n_tokens=5, rid="r1"):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(n_tokens)),
                             sampling_params=SamplingParams(max_tokens=3, temperature=0.0))


def _bytes(frames):
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("n_tokens", [5, 5000])
def test_add_round_trip_inline_and_aux(n_tokens):
    enc, dec = WireEncoder(aux_min_items=1024), WireDecoder(ENGINE_INPUT_TYPES)
    frames = _bytes(enc.encode(MsgType.ADD, _req(n_tokens)))
    assert len(frames) == (2 if n_tokens < 1024 else 3)
    t, obj = dec.decode(frames)
    assert t == MsgType.ADD and obj == _req(n_tokens)


def test_reused_buffer_is_overwritten_but_copies_survive():
    enc, dec = WireEncoder(), WireDecoder(ENGINE_INPUT_TYPES)
    a = _bytes(enc.encode(MsgType.ABORT, AbortRequests(request_ids=["a"])))
    b = _bytes(enc.encode(MsgType.ABORT, AbortRequests(request_ids=["bb"])))
    assert dec.decode(a)[1].request_ids == ["a"] and dec.decode(b)[1].request_ids == ["bb"]


def test_outputs_logprobs_pack_round_trip():
    outs = EngineCoreOutputs(engine_index=2, timestamp=1.5, scheduler_stats=SchedulerStats(num_running=3),
                             outputs=[
        EngineCoreOutput(request_id=f"r{i}", new_token_ids=[i],
                         new_logprobs=[Logprobs([i, 1, 2], [-0.1, -2.5, -3.25], 0)] * 400 if i % 2 else None)
        for i in range(5)])
    enc, dec = WireEncoder(aux_min_items=100), WireDecoder(FRONTEND_INPUT_TYPES)
    frames = _bytes(enc.encode(MsgType.OUTPUTS, outs))
    assert len(frames) == 5
    assert dec.decode(frames)[1] == outs
    small = WireEncoder(aux_min_items=10**9).encode(MsgType.OUTPUTS, outs)
    assert len(small) == 2 and dec.decode(_bytes(small))[1] == outs


def test_identity_round_trip():
    assert engine_index_of(engine_identity(300)) == 300


def test_malformed_inputs_raise_wire_format_error_only():
    dec = WireDecoder(ENGINE_INPUT_TYPES, max_message_bytes=1 << 20)
    enc = WireEncoder(reuse_buffer=False)
    good = _bytes(enc.encode(MsgType.ADD, _req(2000)))
    rng = random.Random(0)
    cases = [[], [b""], [MsgType.HELLO, msgspec.msgpack.encode(Hello(engine_index=0, pid=1, protocol_version=1))],
             [MsgType.WAKEUP, b"\x80"], [b"\xff", b"\x80"], [MsgType.ADD, b"\x80"],
             [MsgType.ADD, good[1], b"abc"], [MsgType.ADD, b"x" * (2 << 20)], good + [b""]]
    for _ in range(3000):
        frames = list(good)
        i = rng.randrange(len(frames))
        buf = bytearray(frames[i])
        for _ in range(rng.randint(1, 4)):
            if buf:
                buf[rng.randrange(len(buf))] = rng.randrange(256)
        if rng.random() < 0.3:
            buf = buf[:rng.randrange(len(buf) + 1)]
        frames[i] = bytes(buf)
        cases.append(frames)
    n_ok = 0
    for frames in cases:
        try:
            dec.decode(frames)
            n_ok += 1
        except WireFormatError:
            pass
    assert n_ok < len(cases)
    with pytest.raises(WireFormatError) as info:
        dec.decode([MsgType.ADD, msgspec.msgpack.encode({"request_id": "bad-1", "prompt_token_ids": "x"})])
    assert info.value.request_id == "bad-1"


def test_recover_call_id_and_dead_struct():
    frames = [MsgType.UTILITY, msgspec.msgpack.encode({"call_id": 7, "method": 3})]
    with pytest.raises(WireFormatError):
        WireDecoder(ENGINE_INPUT_TYPES).decode(frames)
    assert recover_call_id(frames) == 7
    enc = WireEncoder()
    t, obj = WireDecoder(FRONTEND_INPUT_TYPES).decode(_bytes(enc.encode(
        MsgType.ENGINE_CORE_DEAD, EngineDead(engine_index=1, reason="boom"))))
    assert obj == EngineDead(engine_index=1, reason="boom")
    assert WireDecoder(ENGINE_INPUT_TYPES).decode(_bytes(enc.encode(
        MsgType.UTILITY, UtilityCall(call_id=1, method="ping"))))[1].args == {}


def test_reused_buffer_survives_live_references():
    enc = WireEncoder()
    kept = [enc.encode(MsgType.ABORT, AbortRequests(request_ids=["x" * n])) for n in (1, 500, 2)]
    assert len(kept) == 3  # no BufferError while earlier frames are still referenced


def test_aux_frames_decode_from_zmq_buffers_to_python_numbers():
    """Frames as the sockets hand them over (memoryviews of zmq buffers, recv copy=False):
    aux arrays are read in place and come out as lists of Python ints and floats."""
    enc = WireEncoder(aux_min_items=100)
    add = enc.encode(MsgType.ADD, _req(3000))
    views = [memoryview(bytes(f)) for f in add]
    _, obj = WireDecoder(ENGINE_INPUT_TYPES).decode(views)
    assert obj.prompt_token_ids == list(range(3000)) and type(obj.prompt_token_ids[7]) is int
    outs = EngineCoreOutputs(engine_index=0, outputs=[EngineCoreOutput(
        request_id="r", new_token_ids=[1], new_logprobs=[Logprobs([5, 6], [-0.5, -1.75], 1)] * 60)])
    frames = [memoryview(bytes(f)) for f in enc.encode(MsgType.OUTPUTS, outs)]
    assert len(frames) == 5
    got = WireDecoder(FRONTEND_INPUT_TYPES).decode(frames)[1].outputs[0].new_logprobs
    assert got == outs.outputs[0].new_logprobs
    assert type(got[0].token_ids[0]) is int and type(got[0].logprobs[0]) is float
    bad = list(add[:2]) + [bytes(add[2])[:-2]]  # not a whole number of int32s
    with pytest.raises(WireFormatError):
        WireDecoder(ENGINE_INPUT_TYPES).decode(bad)


def test_utility_result_carries_an_error_code():
    enc, dec = WireEncoder(), WireDecoder(FRONTEND_INPUT_TYPES)
    failed = UtilityResult(call_id=3, ok=False, error="EngineStateError: cannot pause in state paused",
                           code=UtilityErrorCode.BAD_STATE.value, engine_index=1)
    t, got = dec.decode(_bytes(enc.encode(MsgType.UTILITY_RESULT, failed)))
    assert t == MsgType.UTILITY_RESULT and got == failed
    assert UtilityErrorCode.of(got.code) is UtilityErrorCode.BAD_STATE
    # omit_defaults: a success sends no code at all.
    ok = _bytes(enc.encode(MsgType.UTILITY_RESULT, UtilityResult(call_id=4, ok=True, result=1)))
    assert "code" not in msgspec.msgpack.decode(ok[1])


@pytest.mark.parametrize("payload,code", [
    # An engine older than the field: no code, still decodes; read as INTERNAL.
    ({"call_id": 5, "ok": False, "error": "PermissionError: nope"}, UtilityErrorCode.INTERNAL),
    # A newer engine's code this side does not know: still decodes; read as INTERNAL.
    ({"call_id": 5, "ok": False, "error": "x", "code": "quota"}, UtilityErrorCode.INTERNAL),
    ({"call_id": 5, "ok": False, "error": "x", "code": "conflict"}, UtilityErrorCode.CONFLICT),
])
def test_utility_result_code_is_backward_compatible(payload, code):
    frames = [MsgType.UTILITY_RESULT, msgspec.msgpack.encode(payload)]
    _, got = WireDecoder(FRONTEND_INPUT_TYPES).decode(frames)
    assert got.ok is False and UtilityErrorCode.of(got.code) is code


def test_utility_error_codes_are_lowercase_wire_strings():
    assert {c.value for c in UtilityErrorCode} == {"unknown_method", "bad_argument", "bad_state",
                                                  "conflict", "permission", "internal"}


def test_a_step_with_big_prompt_logprobs_goes_in_messages_under_the_receivers_limit():
    """Two requests finish their prefill in one step with prompt logprobs of long prompts,
    a third gets an ordinary token: sent as one message the step passed the frontend's
    limit and the frontend dropped it whole (the third request's token lost with it). Split
    as proc.py sends them, every message decodes and every output arrives, in order."""
    from planaria.engine.wire import WireDecoder, WireEncoder, output_size, split_outputs

    def big(rid: str) -> EngineCoreOutput:
        entries = [Logprobs(token_ids=list(range(21)), logprobs=[-1.5] * 21, sampled_rank=3) for _ in range(40_000)]
        return EngineCoreOutput(request_id=rid, new_token_ids=[7], prompt_logprobs=entries)

    outputs = [big("a"), big("b"), EngineCoreOutput(request_id="c", new_token_ids=[9])]
    limit = 12 * 2**20
    enc, dec = WireEncoder(), WireDecoder(FRONTEND_INPUT_TYPES, max_message_bytes=limit)
    whole = enc.encode(MsgType.OUTPUTS, EngineCoreOutputs(outputs=outputs))
    assert sum(len(f) for f in whole) > limit  # as one message: refused, all three lost
    with pytest.raises(WireFormatError):
        dec.decode(whole)
    runs = split_outputs(outputs, budget_bytes=10 * 2**20)
    assert len(runs) == 3
    got = []
    for run in runs:
        frames = enc.encode(MsgType.OUTPUTS, EngineCoreOutputs(outputs=run))
        assert sum(len(f) for f in frames) <= min(limit, sum(output_size(o) for o in run))
        _, msg = dec.decode(frames)
        got += msg.outputs
    assert [o.request_id for o in got] == ["a", "b", "c"] and got[2].new_token_ids == [9]
    assert got[0].prompt_logprobs[-1].sampled_rank == 3
    assert split_outputs([]) == [[]] and len(split_outputs(outputs[2:])) == 1
