"""engine/proc.py ``_utility``: the one place a utility's exception becomes a
``UtilityErrorCode``; the frontend decides on the code, never on the error text."""

from __future__ import annotations

import pytest

from planaria.engine.errors import WeightLoadError, WeightLoadInProgressError
from planaria.engine.proc import EngineCoreProc
from planaria.engine.wire import UtilityCall, UtilityErrorCode


class _Core:
    """Just what the utilities below touch."""

    def __init__(self, raises: BaseException | None = None) -> None:
        self.raises = raises
        self.step_counter = 0

    def load_weights(self, model_dir, version, mode, on_read=None):
        raise self.raises

    def get_stats(self):
        raise self.raises


def _proc(core: _Core | None = None, fault_injection: bool = False) -> EngineCoreProc:
    proc = EngineCoreProc(0, ["ipc:///nonexistent"], None)
    proc.core = core or _Core()
    proc._fault_injection = fault_injection
    return proc


def _call(proc: EngineCoreProc, method: str, **args):
    return proc._utility(UtilityCall(call_id=7, method=method, args=args))


@pytest.mark.parametrize("proc_kwargs,method,args,code,text", [
    ({}, "reboot", {}, UtilityErrorCode.UNKNOWN_METHOD, "unknown utility method 'reboot'"),
    ({}, "pause", {}, UtilityErrorCode.BAD_STATE, "cannot pause in state starting"),
    ({}, "resume", {}, UtilityErrorCode.BAD_STATE, "cannot resume in state starting"),
    ({}, "pause", {"now": True}, UtilityErrorCode.BAD_ARGUMENT, "TypeError"),
    ({}, "load_weights", {}, UtilityErrorCode.BAD_ARGUMENT, "model_dir"),
    ({}, "fault_inject", {"kind": "fatal"}, UtilityErrorCode.PERMISSION, "fault injection is disabled"),
    ({"fault_injection": True}, "fault_inject", {"kind": "meteor"}, UtilityErrorCode.BAD_ARGUMENT,
     "ValueError: unknown fault kind 'meteor'"),
    ({"core": _Core(WeightLoadInProgressError("a weight load is already in progress"))}, "load_weights",
     {"model_dir": "/new"}, UtilityErrorCode.CONFLICT, "WeightLoadInProgressError: a weight load"),
    ({"core": _Core(WeightLoadError("/new is another architecture"))}, "load_weights",
     {"model_dir": "/new"}, UtilityErrorCode.BAD_ARGUMENT, "WeightLoadError: /new is another architecture"),
    # A TypeError from inside a utility whose arguments fit is the engine's bug, not the caller's.
    ({"core": _Core(TypeError("unsupported operand"))}, "get_stats", {}, UtilityErrorCode.INTERNAL,
     "TypeError: unsupported operand"),
    ({"core": _Core(RuntimeError("boom"))}, "get_stats", {}, UtilityErrorCode.INTERNAL, "RuntimeError: boom"),
])
def test_failures_carry_a_code(proc_kwargs, method, args, code, text):
    result = _call(_proc(**proc_kwargs), method, **args)
    assert not result.ok and result.call_id == 7 and result.engine_index == 0
    assert result.code == code.value and UtilityErrorCode.of(result.code) is code
    assert text in result.error


def test_success_carries_no_code():
    result = _call(_proc(), "ping")
    assert result.ok and result.code is None and result.result["state"] == "starting"
